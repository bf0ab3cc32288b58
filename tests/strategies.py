"""Hypothesis strategies shared by the unit and simulator tests.

Values come from deliberately small pools so that random filters and events actually overlap:
covering, matching and routing are only exercised when filters relate to each other.
"""

from __future__ import annotations

from hypothesis import strategies as st

from canopy_broker.core.filters import Constraint, Filter, Op

ATTRS = ["a", "b", "c"]
STRINGS = ["", "a", "ab", "abc", "b", "ba", "bab", "c", "ca"]
NUMBERS = [-1, 0, 0.5, 1, 2, 2.5, 3, 10]

numbers = st.sampled_from(NUMBERS)
strings = st.sampled_from(STRINGS)
values = st.one_of(numbers, strings, st.booleans())


@st.composite
def constraints(draw: st.DrawFn) -> Constraint:
    attr = draw(st.sampled_from(ATTRS))
    kind = draw(st.sampled_from(["number", "string", "bool", "exists"]))
    if kind == "exists":
        return Constraint(attr, Op.EXISTS)
    if kind == "bool":
        return Constraint(attr, draw(st.sampled_from([Op.EQ, Op.NE])), draw(st.booleans()))
    if kind == "number":
        ops = [Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE]
        return Constraint(attr, draw(st.sampled_from(ops)), draw(numbers))
    ops = list(Op)
    ops.remove(Op.EXISTS)
    return Constraint(attr, draw(st.sampled_from(ops)), draw(strings))


filters = st.lists(constraints(), max_size=3).map(Filter.of)
events = st.dictionaries(st.sampled_from(ATTRS), values, max_size=3)


def all_events() -> list[dict[str, object]]:
    """Every event over the pools with up to two attributes: a brute-force semantic universe."""
    single = [{}] + [{a: v} for a in ATTRS for v in [*NUMBERS, *STRINGS, True, False]]
    pairs = [
        {a: v, b: w}
        for i, a in enumerate(ATTRS)
        for b in ATTRS[i + 1 :]
        for v in [*NUMBERS, *STRINGS, True, False]
        for w in [*NUMBERS, *STRINGS, True, False]
    ]
    return single + pairs


# JSON of any shape (what a hostile peer may send where an object is expected).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
