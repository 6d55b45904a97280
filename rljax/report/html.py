"""The run report: one static, self-contained HTML page (``rljax view``).

:func:`build_report` reads a workdir's ``metrics.jsonl`` and ``rollouts/step_<S>.jsonl`` files
(:mod:`rljax.report.records`) and returns a page whose data is inline JSON and whose script and
style are inline too (``assets/report.js``, ``assets/report.css``): it opens from ``file://`` with
no server and no network. The page shows

* metric plots (inline SVG): the usual keys, and any other key picked from a list;
* per saved step, its rollouts: one card per trajectory with its reward, status (trained /
  filtered / errored / dropped), how it ended and how many merged samples it trained in; per turn the
  messages sent and the completion, each token coloured by a switch: its logprob (``exp(logprob)``,
  red = unlikely), its advantage (red < 0 < green) or its loss mask (green = trained, grey =
  masked), with the token id / logprob / advantage / mask on hover; a coloured bar and label per
  merged sample, so where the merge started a new sample shows.

After rendering, the page writes a summary into ``#status`` (``data-state="ok"``, the rollout and
token counts) and its title, or the error (``data-state="error"``); tests read it with a headless
browser's ``--dump-dom``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any

from rljax.report import metrics as metrics_lib
from rljax.report.records import ROLLOUTS_DIR, read_rollout_records

__all__ = ["build_report", "report_data", "write_report"]

ASSETS = pathlib.Path(__file__).with_name("assets")
#: Record fields the page does not need (prompt ids are long; their count is kept).
_DROPPED = ("prompt_ids",)


def _step_files(workdir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    found = []
    for path in (workdir / ROLLOUTS_DIR).glob("step_*.jsonl"):
        m = re.fullmatch(r"step_(\d+)\.jsonl", path.name)
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found)


def report_data(
    workdir: str | os.PathLike, *, max_trajectories: int = 64, steps: list[int] | None = None
) -> dict[str, Any]:
    """The page's data: ``metrics`` (the JSONL rows) and ``steps`` ``{S: [records]}`` (at most
    ``max_trajectories`` trajectories per step, the first ones; ``steps`` None = every saved step)."""
    workdir = pathlib.Path(workdir)
    metrics_path = workdir / metrics_lib.JSONL_NAME
    metrics = metrics_lib.read_jsonl(metrics_path) if metrics_path.exists() else []
    out_steps: dict[str, list[dict[str, Any]]] = {}
    for step, path in _step_files(workdir):
        if steps is not None and step not in steps:
            continue
        records, kept = [], []
        for r in read_rollout_records(path):
            if r["trajectory_id"] not in kept:
                if len(kept) == max_trajectories:
                    continue
                kept.append(r["trajectory_id"])
            prompt_len = len(r.get("prompt_ids") or ())
            records.append({k: v for k, v in r.items() if k not in _DROPPED} | {"prompt_len": prompt_len})
        out_steps[str(step)] = records
    return {
        "workdir": str(workdir.absolute()),
        "name": workdir.absolute().name,
        "metrics": metrics,
        "steps": out_steps,
    }


def _inline_json(data: Any) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>`` and ``&`` escaped as ``\\u003c`` etc."""
    text = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def build_report(
    workdir: str | os.PathLike, *, max_trajectories: int = 64, steps: list[int] | None = None
) -> str:
    """The HTML text of the report of ``workdir`` (see the module docstring)."""
    data = report_data(workdir, max_trajectories=max_trajectories, steps=steps)
    css = (ASSETS / "report.css").read_text()
    js = (ASSETS / "report.js").read_text()
    title = f"rljax report: {data['name']}"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_escape(title)}</title>\n<style>\n{css}\n</style>\n</head>\n<body>\n"
        '<div id="app"></div>\n<div id="status" data-state="loading">loading</div>\n'
        f'<script id="report-data" type="application/json">{_inline_json(data)}</script>\n'
        f"<script>\n{js}\n</script>\n</body>\n</html>\n"
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def write_report(
    workdir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_trajectories: int = 64,
    steps: list[int] | None = None,
) -> pathlib.Path:
    """Writes :func:`build_report` of ``workdir`` to ``out``; returns its path."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_report(workdir, max_trajectories=max_trajectories, steps=steps), encoding="utf-8")
    return out
