"""One quantity measured by several experiments, side by side with where each row came from.

Two notebooks can time the same thing (the state-space value and gradient at the one-eighth length, say) in
different sittings, at different commits and under different load. A chapter that quotes one of them shows this
table so a reader can tell the values apart:

    cases = [("state-space x1, K = 5", "state_space", "ladder", "median_s", dict(backend="state_space", scale=1)),
             ("state-space x1, K = 5", "scaling", "value_and_grad", "median_s", dict(backend="state_space",
              layout="one_run", scale=1))]
    show_table(provenance_table(df, cases), kind="provenance")
"""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from . import book as mb

__all__ = ["provenance_rows", "provenance_table", "where", "source"]


def provenance_rows(df: pd.DataFrame, notebook: str, experiment: str, metric: str, **params) -> pd.DataFrame:
    """Measured rows of one quantity: per device its most preferred profile, the latest row of that profile."""
    sub = df[(df["notebook"] == notebook) & (df["experiment"] == experiment) & (df["metric"] == metric)
             & (df["status"] == "measured")] if "notebook" in df else df.iloc[0:0]
    for k, v in params.items():
        sub = sub[sub[k] == v] if k in sub else sub.iloc[0:0]
    if sub.empty:
        return sub
    rank = {p: i for i, p in enumerate(mb.PROFILE_ORDER)}
    sub = sub.assign(_rank=sub["profile"].map(lambda p: rank.get(p, len(rank))))
    sub = sub[sub["_rank"] == sub.groupby("device")["_rank"].transform("min")]
    if "info_timestamp" in sub:
        sub = sub.sort_values("info_timestamp", na_position="first", kind="stable")
    return sub.drop_duplicates("device", keep="last").drop(columns="_rank")


def source(df: pd.DataFrame, notebook: str, experiment: str | None = None) -> tuple[str | None, str | None]:
    """The (device, profile) a chapter quotes for one notebook (experiment): the most preferred profile present
    on any device, the device with the latest measured row of that profile. ``(None, None)`` if nothing."""
    sub = df[(df["notebook"] == notebook) & (df["status"] == "measured")] if "notebook" in df else df.iloc[0:0]
    if experiment is not None:
        sub = sub[sub["experiment"] == experiment]
    if sub.empty:
        return None, None
    rank = {p: i for i, p in enumerate(mb.PROFILE_ORDER)}
    sub = sub.assign(_rank=sub["profile"].map(lambda p: rank.get(p, len(rank))))
    sub = sub[sub["_rank"] == sub["_rank"].min()]
    if "info_timestamp" in sub:
        sub = sub.sort_values("info_timestamp", na_position="first", kind="stable")
    last = sub.iloc[-1]
    return last["device"], last["profile"]


def where(row) -> str:
    """``device, profile profile, notebook/experiment, commit abc1234`` for one row (a Series), as plain text for
    ``{glue:text}`` (which renders no markup)."""
    commit = str(row.get("info_git_commit") or "")[:7] or "unknown commit"
    return f"{row['device']}, {row['profile']} profile, {row['notebook']}/{row['experiment']}, commit {commit}"


def provenance_table(df: pd.DataFrame, cases: Sequence[tuple[str, str, str, str, dict]]) -> pd.DataFrame:
    """One line per (quantity, experiment, device): the value with its unit and where the row came from.

    ``cases``: ``(quantity label, notebook, experiment, metric, params)``.
    """
    lines = []
    for label, notebook, experiment, metric, params in cases:
        rows = provenance_rows(df, notebook, experiment, metric, **params)
        if rows.empty:
            lines.append({"quantity": label, "notebook": notebook, "experiment": experiment, "device": "",
                          "profile": "", "commit": "", "measured at (UTC)": "", "load (1 min)": "",
                          "value": "no row yet"})
            continue
        for _, r in rows.iterrows():
            lines.append({"quantity": label, "notebook": notebook, "experiment": experiment, "device": r["device"],
                          "profile": r["profile"], "commit": str(r.get("info_git_commit") or "")[:7],
                          "measured at (UTC)": str(r.get("info_timestamp") or "")[:16].replace("T", " "),
                          "load (1 min)": r.get("info_load_average_1m"),
                          "value": mb.fmt(r["value"], r.get("unit") or None)})
    return pd.DataFrame(lines).set_index(["quantity", "notebook", "experiment", "device"])
