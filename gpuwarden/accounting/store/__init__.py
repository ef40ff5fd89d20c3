"""The accounting store: `sacct --json` exports ingested once into Parquet, partitioned by the
UTC day each run ended (`day=YYYY-MM-DD/`), with a manifest of what was ingested; the lemon
scan, `fleet mttf` and `report` read it (`--store`) instead of parsing the exports again.

- `schema`: the columns (one row per job record, the fields of `slurm.models.AcctJob`) and
  the schema version;
- `manifest`: what the store holds (each export ingested, its window and files), read and
  written atomically, the version checked;
- `ingest`: exports into the store, each read once;
- `scan`: the store read back: the bulk of the runs tallied on columns (polars), the rest as
  records for the attribution's own rules;
- `events`: the node events (`sacctmgr show events`) kept beside the runs.

docs/report.md ("The accounting store") documents the layout and the columns.
"""

from gpuwarden.accounting.store.storedir import StoreError

__all__ = ["StoreError"]
