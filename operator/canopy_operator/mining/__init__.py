"""Telemetry mining on Spark: associativity, underlay distance, replayed gains, proposals.

The job reads the brokers' telemetry (schema ``canopy.telemetry/v1``, see docs/broker.md), computes
the metrics of paper 001 with DataFrame joins and aggregations, and turns them into
``TopologyProposal`` objects (docs/mining.md). Nothing else in Canopy imports this package: it is
a leaf that depends on the telemetry schema and the operator's topology and proposal models.

Modules: ``session`` (one local or cluster Spark session), ``source`` (read and clean telemetry;
pull it from brokers), ``metrics`` (the measured state of the overlay), ``propose`` (candidates,
replay, ranking), ``job`` (the pipeline and ``canopy mine``), ``synth`` and ``bench`` (synthetic
telemetry and ``canopy bench mining``).
"""
