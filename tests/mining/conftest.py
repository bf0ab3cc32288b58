"""One local Spark session for every mining test (a JVM takes seconds to start)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from canopy_operator.mining.session import spark_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]", app="canopy-tests", shuffle_partitions=4)
    yield session
    session.stop()
