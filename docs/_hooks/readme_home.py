"""MkDocs hook: the site's home page is the repository's README.md, so the front door has one
copy. Its links into ``docs/`` are made relative to the site (``docs/gpus.md`` -> ``gpus.md``);
its links into ``examples/`` resolve through ``docs/examples``, a link to the folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    readme = Path(config.config_file_path).parent / "README.md"
    text = re.sub(r"\]\(docs/", "](", readme.read_text())
    files.append(File.generated(config, "index.md", content=text))
    return files
