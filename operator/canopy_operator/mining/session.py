"""One Spark session per process, configured for this job's small, join-heavy work.

Why these settings: Spark binds its driver to the machine's outward address unless told
otherwise (``SPARK_LOCAL_IP``), which fails in sandboxes and leaks a port on laptops; the UI is a
web server nobody asked for in a batch job; the default 200 shuffle partitions make every small
aggregation schedule 200 tasks. The session is shared: starting a JVM costs seconds.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"


def spark_session(
    master: str | None = None,
    *,
    app: str = "canopy-mine",
    shuffle_partitions: int | None = None,
    driver_memory: str | None = None,
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """The process's Spark session (created on first use; later calls reuse it).

    ``master`` defaults to ``$CANOPY_SPARK_MASTER`` or ``local[*]``; a ``spark://`` or
    ``k8s://`` master runs the same job on a cluster.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # the mining extra is optional for the operator image
        raise RuntimeError(
            "the mining job needs pyspark: pip install 'canopy[mining]' (and a Java runtime)"
        ) from exc
    master = master or os.environ.get("CANOPY_SPARK_MASTER") or DEFAULT_MASTER
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    parts = shuffle_partitions or _default_partitions(master)
    settings: dict[str, Any] = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",  # the job prints its own progress lines
        "spark.sql.shuffle.partitions": str(parts),
        "spark.sql.adaptive.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.extraJavaOptions": "-Dlog4j2.level=ERROR",
    }
    if driver_memory:
        settings["spark.driver.memory"] = driver_memory
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def _default_partitions(master: str) -> int:
    """A few partitions per local core; Spark's default for a cluster."""
    if master.startswith("local"):
        inside = master[master.find("[") + 1 : master.find("]")] if "[" in master else "1"
        cores = (os.cpu_count() or 2) if inside in ("*", "") else int(inside.split(",")[0])
        return max(2, 2 * cores)
    return 200
