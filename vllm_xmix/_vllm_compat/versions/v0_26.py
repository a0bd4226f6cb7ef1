"""vLLM 0.26.x: the primary version; the component modules are written against it."""

from __future__ import annotations

from . import VersionTable

TABLE = VersionTable(series=(0, 26))
