"""mkdocs hooks: the pages link to the repository's results/, tests/ and benchmarks/ as they sit
beside docs/ (`../results/x.md`, right when browsing the repository); the site takes those files
in under the same names and the links are rewritten to them, so `mkdocs build --strict` still
checks that every linked file exists."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"results": "*", "tests": "*.py", "benchmarks": "*.py"}
LINK = re.compile(r"\]\(\.\./(" + "|".join(FOLDERS) + r")/")


def on_files(files: Files, config) -> Files:
    for folder, pattern in FOLDERS.items():
        for path in sorted((ROOT / folder).glob(pattern)):
            if path.is_file():
                uri = f"{folder}/{path.name}"
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri.count("/") == 0:  # a page of docs/ itself; results pages link as they are
        return LINK.sub(r"](\1/", markdown)
    return markdown
