"""The distributed part of a compare page: the topology line, each rank's collectives and
each rank's keep mask, with the data-parallel replicas that disagree marked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

from m2po_oracle.report.values import as_int, as_list, as_mapping, as_text, fmt, last_line

# Per-rank keep masks are drawn cell by cell; past this they are cut (with a note).
_MASK_ROWS, _MASK_COLS = 12, 16


# More ranks than this would bury the page; the rest are counted, not drawn.
_MAX_RANKS = 64


_AXES = ("dp", "cp", "tp")


_BIT_CLASS: dict[int | None, str] = {1: "k1", 0: "k0"}  # anything else is an unreadable cell, "ku"


def topology_text(raw: Any) -> str:
    """The topology line, e.g. ``dp=2, cp=2, tp=1 on gloo, 4 ranks``; the raw value when it is not a mapping."""
    if not isinstance(raw, Mapping):
        return fmt(raw)
    sizes = [(axis, raw.get(axis)) for axis in _AXES if axis in raw]
    text = ", ".join(f"{axis}={fmt(size)}" for axis, size in sizes) or "unknown layout"
    if raw.get("backend") is not None:
        text += f" on {fmt(raw.get('backend'))}"
    counts = [as_int(raw.get(axis)) for axis in _AXES]
    if all(c is not None and c >= 1 for c in counts):
        assert counts[0] is not None and counts[1] is not None and counts[2] is not None  # all() above
        world = counts[0] * counts[1] * counts[2]
        text += f", {world} rank{'' if world == 1 else 's'}"
    return text


def _coords(raw: Any) -> dict[str, str]:
    coords = as_mapping(raw)
    return {axis: fmt(coords.get(axis)) for axis in _AXES}


def _bytes(value: Any) -> str:
    """Human-readable byte count, binary units: 16 B, 1.5 KiB, 2.0 MiB."""
    n = as_int(value)
    if n is None:
        return fmt(value)
    if abs(n) >= 1024**6:  # beyond PiB: a hand-edited report; float() could overflow
        return f"{n} B"
    size, unit = float(abs(n)), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            break
        size, unit = size / 1024, next_unit
    sign = "-" if n < 0 else ""
    return f"{sign}{int(size)} B" if unit == "B" else f"{sign}{size:.1f} {unit}"


def collectives_view(raw: Any) -> dict[str, Any]:
    """The per-rank collective counts of one step: a column pair per kind, a total row."""
    entries = [e for e in as_list(raw) if isinstance(e, Mapping)]
    kinds: list[str] = []
    for entry in entries:
        for kind in as_mapping(entry.get("collectives")):
            if as_text(kind) not in kinds:
                kinds.append(as_text(kind))
    totals = {kind: [0, 0] for kind in kinds}

    def cell(stats: Any, kind: str) -> dict[str, str]:
        if stats is None:
            return {"calls": "\u2014", "bytes": "\u2014", "exact": ""}
        stats = as_mapping(stats)
        calls, size = as_int(stats.get("calls")), as_int(stats.get("bytes"))
        if calls is not None:
            totals[kind][0] += calls
        if size is not None:
            totals[kind][1] += size
        return {"calls": fmt(stats.get("calls")), "bytes": _bytes(stats.get("bytes")), "exact": f"{size} bytes" if size is not None else ""}

    rows = []
    for entry in entries[:_MAX_RANKS]:
        stats = {as_text(k): v for k, v in as_mapping(entry.get("collectives")).items()}
        rows.append(
            {
                "rank": fmt(entry.get("rank")),
                "coords": _coords(entry.get("coords")),
                "cells": [cell(stats.get(kind), kind) for kind in kinds],
            }
        )
    for entry in entries[_MAX_RANKS:]:  # counted in the totals even when not drawn
        stats = {as_text(k): v for k, v in as_mapping(entry.get("collectives")).items()}
        for kind in kinds:
            if stats.get(kind) is not None:
                cell(stats[kind], kind)
    return {
        "kinds": kinds,
        "rows": rows,
        "hidden": max(len(entries) - _MAX_RANKS, 0),
        "total": [{"calls": str(calls), "bytes": _bytes(size), "exact": f"{size} bytes"} for calls, size in totals.values()],
    }


def _bit(value: Any) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    return None


def _mask(raw: Any) -> tuple[tuple[int | None, ...], ...] | None:
    """A rank's keep mask as rows of 0/1 (None for an unreadable cell); None when absent or not a 2-D list."""
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        return None
    rows = []
    for row in raw:
        if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
            return None
        rows.append(tuple(_bit(c) for c in row))
    return tuple(rows)


def _rows_text(raw: Any) -> str:
    bounds = as_list(raw)
    if len(bounds) != 2:
        return "\u2014" if not bounds else fmt(bounds)
    start, stop = (as_int(b) for b in bounds)
    if start is None or stop is None:
        return fmt(bounds)
    if stop <= start:
        return "none"
    return f"{start}" if stop - start == 1 else f"{start}..{stop - 1}"


def padding_cells(raw_tokens: Any) -> set[tuple[int, int]]:
    """(row, column) of the padding tokens the token table lists (it may be truncated)."""
    padded: set[tuple[int, int]] = set()
    for t in map(as_mapping, as_list(raw_tokens)):
        index = [as_int(i) for i in as_list(t.get("index"))]
        if t.get("valid") is False and len(index) == 2 and None not in index:
            assert index[0] is not None and index[1] is not None  # None not in index
            padded.add((index[0], index[1]))
    return padded


def ranks_view(raw: Any, number: int, padding: Set[tuple[int, int]] = frozenset()) -> dict[str, Any]:
    """Per-rank results of one counterexample, with DP replica groups that disagree on the mask.

    Ranks with the same ``dp`` coordinate hold replicas of the same rows and must keep the
    same mask. In a group that does not, every rank is highlighted, masks are labelled
    A, B, ... by how many ranks keep them (first seen wins a tie), and cells that differ
    from mask A are marked.
    """
    entries = as_list(raw)
    ranks = [e for e in entries if isinstance(e, Mapping)]
    info: dict[str, Any] = {
        "malformed": not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(ranks) != len(entries),
        "rows": [],
        "groups": [],
        "truncated": False,
        "hidden": max(len(ranks) - _MAX_RANKS, 0),
        "limit": f"{_MASK_ROWS} rows \u00d7 {_MASK_COLS} tokens",
    }
    masks = [_mask(r.get("keep")) for r in ranks]
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(ranks):
        dp = as_mapping(r.get("coords")).get("dp")
        if dp is not None and masks[i] is not None:
            groups.setdefault(fmt(dp), []).append(i)
    label: dict[int, str] = {}
    reference: dict[int, tuple[tuple[int | None, ...], ...]] = {}
    for dp, members in groups.items():
        variants: dict[Any, list[int]] = {}
        for i in members:
            variants.setdefault(masks[i], []).append(i)
        if len(variants) < 2:
            continue
        ordered = sorted(variants.items(), key=lambda item: -len(item[1]))  # stable: first seen wins a tie
        for n, (_, holders) in enumerate(ordered):
            letter = _letter(n)
            for i in holders:
                label[i], reference[i] = letter, ordered[0][0]
        info["groups"].append({"dp": dp, "ranks": ", ".join(fmt(ranks[i].get("rank")) for i in members), "masks": len(variants)})

    for i, r in enumerate(ranks[:_MAX_RANKS]):
        mask = masks[i]
        error, stack = r.get("error"), r.get("stack")
        row: dict[str, Any] = {
            "rank": fmt(r.get("rank")),
            "coords": _coords(r.get("coords")),
            "rows": _rows_text(r.get("rows")),
            "loss": r.get("loss"),
            "diverges": i in label,
            "variant": label.get(i, ""),
            "error": as_text(error) if error is not None else None,
            "stack": as_text(stack) if stack is not None else None,
            "anchor": f"cx-{number}-rank-{i}",
        }
        row["status"] = "error" if error is not None else "hung" if stack is not None else "returned" if mask is not None else "no mask"
        row["headline"] = last_line(row["error"] or row["stack"] or "")
        if mask is None:
            row.update(kept="\u2014", grid=None, differ=0, cut="", unreadable=r.get("keep") is not None)
        else:
            ref = reference.get(i)
            # Rows are labelled with their index in the optimizer batch where the report says where the rank's rows start.
            start = as_int(as_list(r.get("rows"))[0]) if as_list(r.get("rows")) else None
            first = start or 0
            shown = [
                (
                    str(first + ri),
                    [
                        {
                            "text": "?" if c is None else str(c),
                            "cls": _BIT_CLASS.get(c, "ku"),
                            "padding": start is not None and (first + ri, ci) in padding,
                            "differs": ref is not None and _cell(ref, ri, ci) != c,
                        }
                        for ci, c in enumerate(mask_row[:_MASK_COLS])
                    ],
                )
                for ri, mask_row in enumerate(mask[:_MASK_ROWS])
            ]
            if ref is None or ref == mask:
                row["differ"] = 0
            else:  # over the whole mask, not just the part drawn, and positions only one side has
                height = max(len(mask), len(ref))
                row["differ"] = sum(
                    _cell(mask, ri, ci) != _cell(ref, ri, ci)
                    for ri in range(height)
                    for ci in range(max(len(mask[ri]) if ri < len(mask) else 0, len(ref[ri]) if ri < len(ref) else 0))
                )
            cut = len(mask) > _MASK_ROWS or any(len(line) > _MASK_COLS for line in mask)
            info["truncated"] = info["truncated"] or cut
            row.update(
                kept=f"{sum(1 for line in mask for c in line if c == 1)} / {sum(len(line) for line in mask)}",
                grid=shown,
                unreadable=False,
                cut=f"{len(mask)} \u00d7 {max((len(line) for line in mask), default=0)}" if cut else "",
            )
        info["rows"].append(row)
    info["diverging"] = len(label)
    info["failed"] = [row for row in info["rows"] if row["error"] is not None or row["stack"] is not None]
    return info


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"#{i + 1}"


def _cell(mask: tuple[tuple[int | None, ...], ...], r: int, c: int) -> int | str | None:
    # "absent" (not None, which is an unreadable cell) where the mask has no such position.
    return mask[r][c] if r < len(mask) and c < len(mask[r]) else "absent"
