"""Dagster code location for actlake: thin assets over the library, with lineage in metadata.

Kept in its own package (not `assets/` + `resources/` at the top level) so that installing it
cannot shadow other top-level packages named `assets` or `resources`, and so that `import
actlake` never imports dagster.
"""
