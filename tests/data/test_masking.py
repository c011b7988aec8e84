"""Masking with static shapes: an exact count per sequence, the schemes' shares, purity, and the batch layout."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import positions_from_labels

from truneg.data.blocks import ResumableSampler, load_tokenizer
from truneg.data.masking import MaskedBatches, capped_rate, default_max_predictions, mask_scheme, mask_tokens


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def masked(tokenizer, rows, scheme="bert", seed=1, epoch=0, indices=None, max_predictions=20):
    indices = np.arange(len(rows)) if indices is None else indices
    return mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), scheme,
                       seed=seed, epoch=epoch, indices=indices, max_predictions=max_predictions)


def test_default_max_predictions_follow_bert_recipes(tokenizer):
    assert default_max_predictions(128) == 20 and default_max_predictions(512) == 80
    # the shortest sequence the tools accept, [CLS] w [SEP]: its one word masked, in as many slots as positions
    batch = masked(tokenizer, np.array([[tokenizer.cls_token_id, 2000, tokenizer.sep_token_id]]),
                   max_predictions=default_max_predictions(3))
    assert batch["masked_positions"].tolist() == [[1, 0, 0]] and batch["masked_valid"].tolist() == [[True, False,
                                                                                                     False]]


@pytest.mark.parametrize("scheme,mask_share,random_share", [("bert", 0.8, 0.1), ("electra", 0.85, 0.0)])
def test_exact_count_and_shares(tokenizer, scheme, mask_share, random_share):
    rows = np.random.default_rng(0).integers(1000, 30000, (400, 128))
    rows[:, 0], rows[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    rows[:5, 100:-1] = tokenizer.pad_token_id  # a few rows with fewer maskable tokens
    batch = {k: v.numpy() for k, v in masked(tokenizer, rows, scheme).items()}
    ids, positions, valid = batch["input_ids"], batch["masked_positions"], batch["masked_valid"]
    assert positions.shape == valid.shape == (400, 20)
    maskable = ~np.isin(rows, tokenizer.all_special_ids)
    # BERT's create_pretraining_data: min(max_predictions, max(1, round(0.15 * maskable)))
    expected = [min(20, max(1, int(round(0.15 * m)))) for m in maskable.sum(1)]
    assert valid.sum(1).tolist() == expected
    assert valid.sum(1)[:5].tolist() == [15] * 5 and valid.sum(1)[5] == 19
    selected = np.zeros_like(rows, dtype=bool)
    for b in range(400):
        p = positions[b][valid[b]]
        assert len(set(p.tolist())) == len(p) and (np.diff(p) > 0).all(), "unique and sorted within a row"
        selected[b, p] = True
    assert not (selected & ~maskable).any(), "special tokens are never selected"
    assert (positions[~valid] == 0).all()
    assert (batch["original_ids"] == rows).all() and (ids[~selected] == rows[~selected]).all()
    was_masked = ids[selected] == tokenizer.mask_token_id
    unchanged = ids[selected] == rows[selected]
    assert abs(was_masked.mean() - mask_share) < 0.015
    assert abs((~was_masked & ~unchanged).mean() - random_share) < 0.01


def test_masking_is_a_pure_function_of_seed_epoch_index(tokenizer):
    rows = np.random.default_rng(0).integers(1000, 30000, (4, 64))
    a = masked(tokenizer, rows, indices=np.array([5, 6, 7, 8]), max_predictions=12)
    b = masked(tokenizer, rows[::-1], indices=np.array([8, 7, 6, 5]), max_predictions=12)
    for key in a:
        assert torch.equal(a[key], b[key].flip(0)), "a sequence's mask does not depend on its batch position"
    c = masked(tokenizer, rows, epoch=1, indices=np.array([5, 6, 7, 8]), max_predictions=12)
    assert not torch.equal(a["masked_positions"], c["masked_positions"]), "a new epoch draws new masks"
    same = masked(tokenizer, rows[[0, 0]], indices=np.array([5, 9]), max_predictions=12)
    assert torch.equal(same["masked_positions"][0], a["masked_positions"][0]), "a sequence's mask is its index's"
    assert not torch.equal(same["masked_positions"][0], same["masked_positions"][1]), "each index draws its own"


def test_masked_batches_layout(tokenizer):
    blocks = np.random.default_rng(0).integers(1000, 30000, (20, 16)).astype(np.int32)
    batches = MaskedBatches(blocks, ResumableSampler(20, 4, 1, 0, 0), tokenizer, "electra", seed=0, max_predictions=4)
    batch = next(batches)
    assert set(batch) == {"input_ids", "original_ids", "masked_positions", "masked_valid"}
    assert batch["masked_positions"].shape == (4, 4) and batch["masked_valid"].dtype == torch.bool


def test_positions_from_labels_round_trip():
    labels = torch.full((2, 6), -100)
    labels[0, [1, 4]] = 7
    labels[1, 2] = 9
    positions, valid = positions_from_labels(labels, 3)
    assert positions.tolist() == [[1, 4, 0], [2, 0, 0]] and valid.tolist() == [[True, True, False],
                                                                               [True, False, False]]


def test_background_workers_give_the_same_batches_and_the_consumed_position(tokenizer):
    """Workers read and mask ahead; the batches are those of the training thread, and the position a
    checkpoint stores is the one after the last batch handed out, so a resume continues exactly there."""
    blocks = np.random.default_rng(0).integers(1000, 30000, (40, 16)).astype(np.int32)

    def take(workers, n, state=None):
        sampler = ResumableSampler(40, 4, 1, 0, seed=3)
        if state:
            sampler.load_state_dict(state)
        batches = MaskedBatches(blocks, sampler, tokenizer, "bert", seed=0, max_predictions=4, workers=workers)
        return [next(batches) for _ in range(n)], batches.position

    inline, inline_position = take(0, 13)  # 10 micro-batches an epoch: crosses into the second
    # what the workers pack into one buffer comes out as mask_tokens made it: keys, dtypes, shapes, values
    epoch, indices = next(iter(ResumableSampler(40, 4, 1, 0, seed=3)))
    direct = mask_tokens(blocks[indices], sorted(tokenizer.all_special_ids), tokenizer.mask_token_id, len(tokenizer),
                         "bert", 0, epoch, indices, 4)
    assert list(inline[0]) == list(direct)
    assert all(inline[0][k].dtype == v.dtype and torch.equal(inline[0][k], v) for k, v in direct.items())
    torch.manual_seed(0)
    ahead, ahead_position = take(2, 13)
    torch.manual_seed(0)
    expected_draw = torch.rand(1)
    torch.manual_seed(0)
    take(2, 1)
    assert torch.equal(torch.rand(1), expected_draw), "the workers leave the global torch RNG (dropout) alone"
    assert inline_position == ahead_position == {"epoch": 1, "offset": 12}
    for a, b in zip(inline, ahead):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # on another device (meta stands in for a GPU here): one copy, and every tensor of the batch is there
    sampler = ResumableSampler(40, 4, 1, 0, seed=3)
    moved = next(MaskedBatches(blocks, sampler, tokenizer, "bert", seed=0, max_predictions=4,
                               device=torch.device("meta")))
    assert {k: (v.device.type, v.dtype, v.shape) for k, v in moved.items()} == \
        {k: ("meta", v.dtype, v.shape) for k, v in direct.items()}
    resumed, _ = take(2, 7, state=ahead_position)
    rest, _ = take(0, 20)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(resumed, rest[13:]))


def test_a_stop_signal_to_the_process_group_leaves_the_workers_feeding_the_rank(tmp_path):
    """A scheduler signals the whole process group: the rank must still get its batches to finish the step
    and save (its own handler only sets a flag), so the workers must not die of the signal."""
    child = tmp_path / "rank.py"
    child.write_text(textwrap.dedent("""
        import multiprocessing, os, signal
        import numpy as np
        from truneg.data.blocks import ResumableSampler, load_tokenizer
        from truneg.data.masking import MaskedBatches
        if __name__ == "__main__":
            multiprocessing.set_start_method("forkserver")  # Python 3.14's default on Linux: it must not matter
            received = []
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda s, f: received.append(s))  # as truneg.train.loop.StopSignal
            blocks = np.random.default_rng(0).integers(1000, 30000, (64, 16)).astype(np.int32)
            batches = MaskedBatches(blocks, ResumableSampler(64, 4, 1, 0, seed=3), load_tokenizer(), "bert", seed=0,
                                    max_predictions=4, workers=2)
            next(batches), next(batches)  # one from each worker: both are running
            os.killpg(0, signal.SIGTERM)
            os.killpg(0, signal.SIGINT)
            for _ in range(30):  # more than the workers had read ahead
                next(batches)
            print("signals", sorted(received))
    """))
    proc = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=120,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "signals [2, 15]" in proc.stdout, proc.stdout  # and it exits (its workers stopped) within the timeout


@pytest.mark.parametrize("family", ["bert", "electra"])
def test_a_familys_default_by_name_or_by_its_shares_masks_alike(tokenizer, family):
    rows = np.random.default_rng(3).integers(1000, 30000, (6, 128))
    by_name, by_shares = masked(tokenizer, rows, family), masked(tokenizer, rows, mask_scheme(family))
    assert by_name.keys() == by_shares.keys()
    assert all(torch.equal(by_name[key], by_shares[key]) for key in by_name)


def test_the_mask_rate_and_the_split_of_the_selected_positions(tokenizer):
    rows = np.random.default_rng(4).integers(1000, 30000, (8, 128))
    rows[:, 0], rows[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    slots = default_max_predictions(128, 0.3)
    assert (slots, default_max_predictions(512, 0.3), default_max_predictions(128)) == (40, 156, 20)
    for split in ((1.0, 0.0), (0.0, 1.0), (0.0, 0.0)):
        batch = {k: v.numpy() for k, v in masked(tokenizer, rows, mask_scheme("bert", 0.3, *split),
                                                 max_predictions=slots).items()}
        counts = batch["masked_valid"].sum(axis=1)
        assert (counts == np.rint(0.3 * 126)).all()  # 126 maskable positions a row: 38 masked
        rows_, cols = np.nonzero(batch["masked_valid"])
        picked = batch["masked_positions"][rows_, cols]
        now, was = batch["input_ids"][rows_, picked], batch["original_ids"][rows_, picked]
        masked_share = (now == tokenizer.mask_token_id).mean()
        changed = ((now != was) & (now != tokenizer.mask_token_id)).mean()
        assert masked_share == split[0] and (changed > 0.99 if split[1] else changed == 0), (split, changed)
        unselected = np.ones_like(batch["input_ids"], dtype=bool)
        unselected[rows_, picked] = False
        assert (batch["input_ids"][unselected] == batch["original_ids"][unselected]).all()
    # --max-predictions below what the rate selects caps it, and says so
    assert capped_rate(20, 0.15, 128) is None and "caps the mask rate 0.3" in capped_rate(20, 0.3, 128)


@pytest.mark.parametrize("flags, expected", [
    (["--mlm-probability", "0"], "--mlm-probability"), (["--mlm-probability", "1"], "--mlm-probability"),
    (["--random-replace-prob", "-0.1"], "--random-replace-prob"),
    (["--model", "bert-tiny", "--mask-replace-prob", "0.95"], "together at most 1"),  # BERT's 0.1 random too
    (["--model", "electra-tiny", "--mask-replace-prob", "0.95", "--random-replace-prob", "0.1"], "together at most 1"),
])
def test_masking_flags_out_of_range_are_one_line(flags, expected):
    from truneg.errors import UserError
    from truneg.train.config.args import parse_args

    with pytest.raises(UserError, match=expected):
        parse_args(flags)


def test_the_runs_masking_and_its_default_slots_follow_the_flags():
    from truneg.train.config.args import parse_args
    from truneg.train.config.run_config import RunConfig

    cfg = RunConfig.from_args(parse_args(["--model", "electra-tiny", "--mlm-probability", "0.3"]))
    assert cfg.max_predictions == 40 and cfg.mask_scheme("electra") == (0.3, 0.85, 0.0)
    assert parse_args(["--model", "electra-tiny", "--mask-replace-prob", "0.95"])  # ELECTRA replaces none at random


@pytest.fixture(scope="module")
def novel_rows(tokenizer):
    """The shipped corpus (Austen) in 128-token blocks, framed as truneg frames them."""
    from truneg.data.blocks import DEMO_CORPUS

    text = (DEMO_CORPUS / "austen_pride_and_prejudice.txt").read_text()[:300_000]
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    body = 126
    return np.array([[tokenizer.cls_token_id, *ids[i:i + body], tokenizer.sep_token_id]
                     for i in range(0, len(ids) - body, body)])


def words_of(tokens: list[str], special: set[int], ids: list[int]) -> list[list[int]]:
    """The reference reading of a row's words, position by position: a maskable piece starts a word unless it is
    `##...` right after a maskable piece."""
    words: list[list[int]] = []
    for p, (token, i) in enumerate(zip(tokens, ids)):
        if i in special:
            continue
        if token.startswith("##") and p > 0 and ids[p - 1] not in special and words and words[-1][-1] == p - 1:
            words[-1].append(p)
        else:
            words.append([p])
    return words


def test_whole_word_masking_takes_whole_words_up_to_the_count(tokenizer, novel_rows):
    from truneg.synonyms.table import continuing_pieces

    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    continues, special = continuing_pieces(vocab), set(tokenizer.all_special_ids)
    rows = novel_rows.copy()
    rows[::7, 60] = tokenizer.sep_token_id  # a special mid-row: no word spans it, the piece after it starts one
    indices = np.arange(len(rows))
    batch = mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer),
                        mask_scheme("bert", None, 1.0, 0.0), 5, 0, indices, 20, word_continues=continues)
    target, valid = batch["masked_target"].numpy(), batch["masked_valid"].numpy()
    counts = valid.sum(axis=1)
    maskable = (~np.isin(rows, list(special))).sum(axis=1)
    assert (target == np.minimum(20, np.rint(0.15 * maskable))).all() and (counts <= target).all()
    assert (counts == target).mean() >= 0.99, (counts == target).mean()
    from truneg.model.objectives import masked_shortfall

    assert masked_shortfall(batch["masked_target"], batch["masked_valid"])["mask_shortfall"] == (target - counts).sum()
    for row in range(len(rows)):
        picked = set(batch["masked_positions"][row][valid[row]].tolist())
        ids = rows[row].tolist()
        for word in words_of(vocab_of(vocab, ids), special, ids):
            assert set(word) <= picked or not set(word) & picked, (row, word)  # never part of a word
        assert not any(ids[p] in special for p in picked)
        # the split applies per piece: here every selected piece is [MASK]
        assert all(batch["input_ids"][row, p] == tokenizer.mask_token_id for p in picked)
    # a pure function of (seed, epoch, index): the same rows in another batch, as another rank or a resume reads them
    again = mask_tokens(rows[5:9], tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer),
                        mask_scheme("bert", None, 1.0, 0.0), 5, 0, indices[5:9], 20, word_continues=continues)
    assert all(torch.equal(again[k], batch[k][5:9]) for k in again)


def test_whole_word_masking_of_a_row_with_nothing_maskable_masks_nothing(tokenizer):
    from truneg.synonyms.table import continuing_pieces

    rows = np.full((1, 8), tokenizer.pad_token_id)
    rows[0, 0], rows[0, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    continues = continuing_pieces(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    batch = mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), "bert", 0, 0,
                        np.arange(1), 4, word_continues=continues)
    assert not batch["masked_valid"].any() and batch["masked_target"].tolist() == [0]


def vocab_of(vocab: list[str], ids: list[int]) -> list[str]:
    return [vocab[i] for i in ids]
