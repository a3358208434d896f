"""Debugging and observability: the report gjit.explain returns (report.py), the dump folder (dump.py),
GJIT_CHECK's per-kernel check (check.py) and the modeled bytes of a schedule (byte_model.py)."""
