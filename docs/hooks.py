"""MkDocs hooks: the benchmark pages, and links from a page to repository files outside docs/
(``../benchmarks/README.md``, ``../examples/generate_streamed.py``).

``benchmarks/README.md`` and ``benchmarks/log/*.md`` are pages of the site (`on_files`): each
is added under its source path relative to docs/ (``../benchmarks/README.md``, the path a guide
links with, which also works where the Markdown is read as files) and written under
``benchmarks/`` in the site, so MkDocs resolves links to them and checks their anchors.

MkDocs knows no other file outside docs/, so it would report a link to one as not found (an
error under ``--strict``) and leave it pointing nowhere in the built site. This hook checks that
the target exists in the repository (a missing one is a warning, so ``--strict`` fails) and
points the link at it: at ``repo_url``/blob/main/... when mkdocs.yml sets ``repo_url``, else at
the file in the checkout, relative to the built page (the site is built into site/ inside the
repository). The same links work when the Markdown is read on a code host.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

log = logging.getLogger("mkdocs.hooks.repo_files")

_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")
_SCHEME = "repo-file:"


def on_files(files, config):
    root = Path(config["docs_dir"]).resolve().parent
    for path in sorted((root / "benchmarks").rglob("*.md")):
        inside = path.relative_to(root).as_posix()  # benchmarks/log/x.md
        # The dated log is reached through the links of benchmarks/README.md, not the nav.
        nav = path.parent.name == "benchmarks"
        page = File.generated(
            config,
            "../" + inside,
            abs_src_path=str(path),
            inclusion=InclusionLevel.INCLUDED if nav else InclusionLevel.NOT_IN_NAV,
        )
        page.dest_uri = File.generated(config, inside, content="").dest_uri
        files.append(page)
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir = os.path.abspath(config["docs_dir"])
    root = os.path.dirname(docs_dir)
    page_dir = os.path.dirname(os.path.join(docs_dir, page.file.src_path))

    def rewrite(m: re.Match) -> str:
        target, anchor = m.group(1), m.group(2) or ""
        if ":" in target:  # a URL
            return m.group(0)
        path = os.path.normpath(os.path.join(page_dir, target))
        if os.path.commonpath([path, docs_dir]) == docs_dir:
            return m.group(0)  # inside docs/: MkDocs checks it
        if files.get_file_from_path(os.path.relpath(path, docs_dir).replace(os.sep, "/")):
            return m.group(0)  # a benchmark page (on_files): MkDocs checks it and its anchors
        if os.path.commonpath([path, root]) != root or not os.path.exists(path):
            log.warning(
                "Doc file '%s' links to '%s', which is not a file of the repository",
                page.file.src_path,
                target,
            )
            return m.group(0)
        if anchor:
            log.warning(
                "Doc file '%s' links to '%s%s': link to files outside docs/ without an anchor",
                page.file.src_path,
                target,
                anchor,
            )
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        return f"]({_SCHEME}{rel})"

    return _LINK.sub(rewrite, markdown)


def on_page_content(html, page, config, files):
    if _SCHEME not in html:
        return html
    repo_url = config.get("repo_url")
    site_dir = os.path.abspath(config["site_dir"])
    root = os.path.dirname(os.path.abspath(config["docs_dir"]))
    page_dir = posixpath.dirname(page.file.dest_uri)

    def target(m: re.Match) -> str:
        rel = m.group(1)
        if repo_url:
            return f'href="{repo_url.rstrip("/")}/blob/main/{rel}"'
        here = os.path.join(site_dir, page_dir)
        return f'href="{os.path.relpath(os.path.join(root, rel), here).replace(os.sep, "/")}"'

    return re.sub(r'href="' + re.escape(_SCHEME) + r'([^"]+)"', target, html)
