"""Training jobs and their files in the store (migration 10), on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import math
import attrs
import pytest

from llmgw.control.store import open_store
from llmgw.control.store.base import ConflictError, StoreError
from llmgw.control.store.training import PAIRS, RESULT, NoSuchJob
from llmgw.training import CANCELLED, RESULT_PIECE_BYTES, RUNNING, SUCCEEDED, TrainingJob, TrainingParams
from tests.component.test_store import db_url, raw_connection  # noqa: F401 - the fixture

PAIRS_TEXT = b'{"prompt": "hi", "completion": "hello"}\n' * 3


async def test_a_job_is_stored_updated_and_its_files_come_back_whole(db_url: str) -> None:  # noqa: F811
    async with open_store(db_url) as store:
        job = TrainingJob("j-1", "tiny-qa", "tiny", "/models/tiny", params=TrainingParams(steps=12, rank=4), pairs=3)
        stored = await store.create_training_job(job, PAIRS_TEXT)
        assert stored.created_at > 0 and math.isnan(stored.loss)
        with pytest.raises(ConflictError):
            await store.create_training_job(job, PAIRS_TEXT)
        assert await store.read_training_file("j-1", PAIRS) == PAIRS_TEXT

        running = await store.update_training_job(attrs.evolve(stored, state=RUNNING, assigned_node="n1", gpu=1001,
                                                               step=3, steps=12, loss=2.5, first_loss=3.0))
        again = await store.get_training_job("j-1")
        assert again == running and (again.step, again.loss, again.params.rank) == (3, 2.5, 4)

        result = bytes(range(256)) * (RESULT_PIECE_BYTES // 256 * 2 + 3)  # three pieces
        digest = await store.put_training_file("j-1", RESULT, result)
        assert digest == hashlib.sha256(result).hexdigest()
        assert await store.read_training_file("j-1", RESULT) == result

        done = await store.update_training_job(attrs.evolve(again, state=SUCCEEDED, result_bytes=len(result),
                                                            result_sha256=digest, result_format="peft"))
        late = await store.update_training_job(attrs.evolve(done, state=CANCELLED))
        assert late.state == SUCCEEDED, "a job that ended stays ended"
        assert [j.id for j in await store.list_training_jobs()] == ["j-1"]
        with pytest.raises(NoSuchJob):
            await store.get_training_job("nope")


async def test_a_damaged_piece_is_named_when_read(db_url: str) -> None:  # noqa: F811
    async with open_store(db_url) as store:
        await store.create_training_job(TrainingJob("j-2", "a", "m", "/w", pairs=3), PAIRS_TEXT)
    with raw_connection(db_url) as conn:
        sql = "UPDATE training_files SET data = ? WHERE job_id = 'j-2'"
        conn.execute(sql if db_url.startswith("sqlite") else sql.replace("?", "%s"), (b"tampered",))
    async with open_store(db_url) as store:
        with pytest.raises(StoreError, match="piece 0 of its pairs is damaged"):
            await store.read_training_file("j-2", PAIRS)


