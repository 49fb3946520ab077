"""report.html: the report's Markdown tables and its plots in one self-contained page."""

from __future__ import annotations

import base64
import html as h
from pathlib import Path

STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px}"
    "img{max-width:100%}"
)


def html(markdown_text: str, plots: list[Path]) -> str:
    """A single self-contained page: the report's tables and the plots embedded as data URIs."""
    parts = []
    for block in markdown_text.split("\n\n"):
        lines = block.strip().splitlines()
        if not lines or lines[0].startswith("!["):
            continue
        if lines[0].startswith("|"):
            parts.append(_html_table(lines))
        elif lines[0].startswith("#"):
            level = len(lines[0]) - len(lines[0].lstrip("#"))
            parts.append(f"<h{level}>{h.escape(lines[0].lstrip('# '))}</h{level}>")
        elif all(line.startswith("- ") for line in lines):
            items = "".join(f"<li>{h.escape(line[2:])}</li>" for line in lines)
            parts.append(f"<ul>{items}</ul>")
        else:
            parts.append(f"<p>{h.escape(' '.join(lines))}</p>")
    for p in plots:
        data = base64.b64encode(p.read_bytes()).decode()
        parts.append(f'<figure><img alt="{p.stem}" src="data:image/png;base64,{data}"></figure>')
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvkeep bench report</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def _html_table(lines: list[str]) -> str:
    """A Markdown table (its header, the `|---|` rule, its rows) as an HTML table."""
    cells = [[h.escape(c.strip()) for c in ln.strip().strip("|").split("|")] for ln in lines]
    head = "".join(f"<th>{c}</th>" for c in cells[0])
    rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in cells[2:])
    return f"<table><tr>{head}</tr>{rows}</table>"
