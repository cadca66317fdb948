"""Tests of the benchmark package (``make bench-test``)."""
