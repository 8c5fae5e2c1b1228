"""On start, before the gateway serves: the usage the gateway journaled but never stored
(it crashed between two flushes) goes into the store, exactly once.

:func:`replay_usage_journals` reads every journal left in the directory
(:mod:`llmgw.usage_journal`), adds the records above each journal's stored mark together
with the new mark in one transaction, then deletes the journal's files, then its mark.
A crash between any two steps repeats a step that changes nothing the second time: the
mark makes the records already stored count for nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import trio

from llmgw.control.store import Store
from llmgw.control.store.base import UsageRecord
from llmgw.usage_journal import JournalRecord, read_journals, remove_journal

log = logging.getLogger(__name__)


def usage_rows(records: Iterable[JournalRecord]) -> list[UsageRecord]:
    """Return ``records`` added up per (tenant, model), ordered by tenant and model."""
    totals: dict[tuple[str, str], list[int]] = {}
    for r in records:
        row = totals.setdefault((r.tenant, r.model), [0, 0, 0])
        row[0] += 1
        row[1] += r.prompt_tokens
        row[2] += r.completion_tokens
    return [UsageRecord(tenant, model, *row) for (tenant, model), row in sorted(totals.items())]


async def replay_usage_journals(store: Store, directory: Path) -> int:
    """Store what the usage journals in ``directory`` hold beyond the store's marks, then
    delete them; return how many requests were added.

    Call it only while nothing journals into ``directory`` (before the gateway serves).
    Raises the store's error (the files stay, for the next start). A directory that cannot
    be read is logged and left for the next start; nothing is added then.
    """
    try:
        journals = await trio.to_thread.run_sync(read_journals, directory)
    except OSError as exc:
        log.warning("usage journal: cannot read %s (%s); its usage is replayed at the next start", directory, exc)
        return 0
    if not journals:
        return 0
    marks = await store.usage_marks()
    added = 0
    for journal_id, records in journals.items():
        fresh = [r for r in records if r.seq > marks.get(journal_id, 0)]
        if fresh:
            await store.add_usage(usage_rows(fresh), marks={journal_id: fresh[-1].seq})
            added += len(fresh)
        await trio.to_thread.run_sync(remove_journal, directory, journal_id)
        await store.forget_usage_marks([journal_id])
    if added:
        log.info("usage journal: stored %d request(s) counted before the last stop but never stored", added)
    return added
