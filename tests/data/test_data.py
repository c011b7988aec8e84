"""Corpus packing and caching, the resumable sampler, and the corpus cache (masking: test_masking.py)."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import framed_blocks

from truneg.data.blocks import (
    PreparedBlocks,
    ResumableSampler,
    ensure_prepared,
    load_tokenizer,
    open_prepared,
)
from truneg.data.encoding import pack_blocks
from truneg.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_pack_blocks_frames_each_block_and_returns_the_tail():
    blocks, tail = pack_blocks(np.arange(10, 33), seq_len=6, cls_id=101, sep_id=102, dtype=np.uint16)
    assert blocks.dtype == np.uint16 and blocks.tolist() == framed_blocks(range(10, 33), 6, 101, 102)
    assert blocks.shape == (5, 6) and tail.tolist() == [30, 31, 32]  # 23 tokens -> 5 blocks of 4, a tail of 3


def test_build_blocks_tokenizes_documents_and_caches(tmp_path, tokenizer):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the primary school\nwas closed today\n\nanother document begins here\n")
    path = ensure_prepared(str(corpus), tokenizer, seq_len=6, cache_dir=tmp_path / "cache", num_proc=1)
    blocks = open_prepared(path)
    assert isinstance(blocks, PreparedBlocks)
    expected = tokenizer("the primary school")["input_ids"][1:-1] + tokenizer("was closed today")["input_ids"][1:-1]
    expected += [tokenizer.sep_token_id] + tokenizer("another document begins here")["input_ids"][1:-1]
    assert blocks.shape == (len(expected) // 4, 6)  # every whole block of 4 tokens kept, the rest dropped
    assert (blocks[:, 0] == tokenizer.cls_token_id).all() and (blocks[:, -1] == tokenizer.sep_token_id).all()
    assert blocks[:, 1:-1].reshape(-1).tolist() == expected[: blocks.shape[0] * 4]
    mtime = (path / "index.json").stat().st_mtime_ns
    assert ensure_prepared(str(corpus), tokenizer, 6, tmp_path / "cache", 1) == path
    assert (path / "index.json").stat().st_mtime_ns == mtime, "a prepared corpus is reused, not prepared again"
    assert ensure_prepared(str(corpus), tokenizer, 8, tmp_path / "cache", 1) != path  # seq-len changes the key
    corpus.write_text("a different corpus with other words in it entirely\n")
    assert ensure_prepared(str(corpus), tokenizer, 6, tmp_path / "cache", 1) != path  # content changes the key


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path, tokenizer, capsys):
    corpus = tmp_path / "bad.txt"
    corpus.write_bytes(b"caf\xe9 and more words here to fill a block or two of text\n" * 4)
    path = ensure_prepared(str(corpus), tokenizer, 8, tmp_path / "cache", 1)
    assert open_prepared(path).shape[0] > 0
    assert "4 undecodable bytes" in capsys.readouterr().out


def test_missing_and_empty_corpus_are_clear_errors(tmp_path, tokenizer):
    with pytest.raises(UserError, match="no text files found"):
        ensure_prepared(str(tmp_path / "nope"), tokenizer, 8, tmp_path / "cache", 1)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="is empty"):
        ensure_prepared(str(tmp_path / "empty.txt"), tokenizer, 8, tmp_path / "cache", 1)


def test_sampler_resumes_and_is_independent_of_world_size():
    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    full = take(ResumableSampler(50, 4, 1, 0, seed=9), 30)  # 12 micro-batches an epoch: crosses 2 epochs
    resumed = ResumableSampler(50, 4, 1, 0, seed=9)
    first = take(resumed, 13)
    state = resumed.state_dict()
    again = ResumableSampler(50, 4, 1, 0, seed=9)
    again.load_state_dict(state)
    assert [(e, i.tolist()) for e, i in first + take(again, 17)] == [(e, i.tolist()) for e, i in full]
    two = [ResumableSampler(50, 2, 2, r, seed=9) for r in range(2)]
    steps = [take(s, 12) for s in two]
    merged = [np.concatenate([steps[0][k][1], steps[1][k][1]]).tolist() for k in range(12)]
    assert merged == [i.tolist() for _, i in full[:12]]
    with pytest.raises(UserError, match="fewer than one global batch"):
        ResumableSampler(3, 2, 2, 0, seed=0)
    with pytest.raises(UserError, match=r"fewer than one global batch \(2 x 3 x 2"):
        ResumableSampler(11, 2, 2, 0, seed=0, accumulation=3)
    # The same global batch of 8 split as 2 ranks x 4, or as 1 rank x 4 x 2 micro-steps: the same sequences
    # in every optimizer step, across epoch ends too (53 = 6 x 8 + 5: the 5 left over are dropped either way;
    # counted in micro-steps of 4, the single rank would take a 13th and split a step across two epochs)
    two_ranks = [take(ResumableSampler(53, 4, 2, r, seed=9), 14) for r in range(2)]
    per_step_two = [sorted(np.concatenate([two_ranks[0][k][1], two_ranks[1][k][1]]).tolist()) for k in range(14)]
    one_rank = take(ResumableSampler(53, 4, 1, 0, seed=9, accumulation=2), 28)
    per_step_one = [sorted(np.concatenate([one_rank[2 * k][1], one_rank[2 * k + 1][1]]).tolist()) for k in range(14)]
    assert per_step_one == per_step_two and [e for e, _ in one_rank[::2]] == [0] * 6 + [1] * 6 + [2] * 2
    # `--resume DIR` of a run with a global batch of 8 into one of 12 (3 ranks x 4): offset 16 is no multiple of
    # 12, and the step from 28 would need 40 of the 38 sequences. Every micro-batch stays whole, and the epoch
    # ends for every rank at the same micro-step.
    three = [ResumableSampler(38, 4, 3, r, seed=9) for r in range(3)]
    for sampler in three:
        sampler.load_state_dict({"epoch": 0, "offset": 16})
    after = [take(s, 2) for s in three]
    assert [[len(i) for _, i in rank] for rank in after] == [[4, 4]] * 3
    assert [[e for e, _ in rank] for rank in after] == [[0, 1]] * 3
    assert sorted(np.concatenate([rank[0][1] for rank in after]).tolist()) == sorted(
        np.random.default_rng([9, 0]).permutation(38)[16:28].tolist())


def test_ranks_open_the_folder_their_nodes_local_rank_0_prepared_without_planning_again(tmp_path, tokenizer,
                                                                                        monkeypatch):
    """Only each node's local rank 0 plans the corpus (for `hf:` on the Hub, requests per file): the others take
    its folder from a collective, here two nodes of two ranks seen from rank 3 (node-b's local rank 1)."""
    import socket

    from truneg.data import blocks as data
    from truneg.train import build
    from truneg.train.config.args import parse_args
    from truneg.train.config.run_config import RunConfig

    corpus = tmp_path / "c.txt"
    corpus.write_text("the primary school was closed today and another document begins here\n" * 8)
    folder = ensure_prepared(str(corpus), tokenizer, 6, tmp_path / "cache", 1)
    elsewhere = tmp_path / "node-a-cache"  # node-a's folder: not this node's

    def gather(found, mine):
        found[:] = [("node-a", str(elsewhere)), ("node-a", None), ("node-b", str(folder)), mine]

    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    monkeypatch.setattr(build.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(build.dist, "all_gather_object", gather)
    monkeypatch.setattr(data, "ensure_prepared", lambda *a, **k: pytest.fail("a rank planned the corpus again"))
    cfg = RunConfig.from_args(parse_args(["--train-data", str(corpus), "--seq-len", "6",
                                          "--cache-dir", str(tmp_path / "cache")]))
    start = build.Start({}, tokenizer, None, None, prepared=None)
    blocks, record = build.open_blocks(cfg, start)
    assert blocks.folder == folder and record == {"data": open_prepared(folder).fingerprint}


def test_hf_dataset_with_a_named_text_column(tmp_path, tokenizer):
    folder = tmp_path / "hf_dataset"
    folder.mkdir()
    (folder / "train.csv").write_text("id,content\n1,the primary school was closed\n2,another row of text here\n")
    path = ensure_prepared(f"hf:{folder}#content", tokenizer, seq_len=6, cache_dir=tmp_path / "cache", num_proc=1)
    expected = tokenizer("the primary school was closed")["input_ids"][1:-1]
    assert open_prepared(path)[0, 1:-1].tolist() == expected[:4]
    with pytest.raises(UserError, match="has no column 'text'"):
        ensure_prepared(f"hf:{folder}", tokenizer, 6, tmp_path / "cache", 1)
