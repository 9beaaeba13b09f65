"""docs/deploy.md quotes every file under deploy/ as it is (the tests load the files, readers copy the docs)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FILES = sorted((REPO / "deploy").rglob("*.yaml"))


def test_there_are_deploy_files() -> None:
    assert {str(p.relative_to(REPO)) for p in FILES} >= {"deploy/celery/celery.yaml", "deploy/postgres/dagster.yaml",
                                                         "deploy/k8s/dagster.yaml", "deploy/k8s/executor.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_quote_the_file_verbatim(path: Path) -> None:
    doc = (REPO / "docs" / "deploy.md").read_text(encoding="utf-8")
    assert f"```yaml\n{path.read_text(encoding='utf-8')}```" in doc, f"docs/deploy.md does not quote {path} as it is"
    assert f"`{path.relative_to(REPO)}`" in doc
