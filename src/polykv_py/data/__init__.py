"""Files shipped with the package: the sample base context used by the benchmark and the examples."""

from __future__ import annotations

from importlib.resources import files

#: The sample design document (about 2,000 tokens); ``examples/design-doc.md`` links to it.
SAMPLE_DOCUMENT = "design-doc.md"


def sample_document() -> str:
    """The text of the sample design document, read from the installed package."""
    return files(__name__).joinpath(SAMPLE_DOCUMENT).read_text(encoding="utf-8")
