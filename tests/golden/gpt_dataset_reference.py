#!/usr/bin/python3
"""Independent reference for Megatron-Core's GPT dataset indices (GPTDataset, BlendedDataset, the
--split and --data-path rules), written from Megatron's documented behaviour with numpy only. Used by
tests/unit/data/test_gpt_dataset.cpp: both read the same tiny corpus and the C++ side requires the same
indices and token windows.

Corpus: a prefix P stands for two raw files, P.lengths (int32 sequence lengths) and P.tokens (int32
tokens of all sequences back to back).

Usage: gpt_dataset_reference.py SPEC.json OUT_DIR
SPEC: {"split_checks": [{"split": "949,50,1", "sizes": [500, ...]}, ...],
       "cases": [{"name": ..., "data_path": [...], "split": ..., "seq_length": T, "seed": s,
                  "num_samples": [n_train, n_valid, n_test], "which": "train"|"valid"|"test",
                  "count": k, "surplus": 0.005}, ...]}
Writes OUT_DIR/split_checks.json, and per case OUT_DIR/<name>.json (sizes, epochs, flags),
<name>.windows (int32, count x (T + 1)), and for a single-prefix case <name>.document_index,
<name>.sample_index, <name>.shuffle_index (int64), for a blend <name>.dataset_index and
<name>.dataset_sample_index (int64, the first `count`).
"""
import json
import math
import os
import re
import sys

import numpy as np

SPLITS = ["train", "valid", "test"]


def normalized(weights):
    arr = np.asarray(weights, dtype=np.float64)
    return list(arr / arr.sum())


def split_bookends(split):
    # Numbers are the runs of digits and dots; missing ones count as 0.
    parts = [float(tok) for tok in re.findall(r"[.0-9]+", split)]
    parts = parts + [0.0] * (3 - len(parts))
    fractions = normalized(parts)
    edges = [0.0]
    for f in fractions:
        edges.append(edges[-1] + f)
    return [(edges[i], edges[i + 1]) if edges[i + 1] > edges[i] else None for i in range(3)]


def sequence_range(bookend, num_sequences):
    # Python's round(): nearest, ties to even.
    return int(round(bookend[0] * float(num_sequences))), int(round(bookend[1] * float(num_sequences)))


class Corpus:
    def __init__(self, prefix):
        self.prefix = prefix
        self.lengths = np.fromfile(prefix + ".lengths", dtype=np.int32)
        self.tokens = np.fromfile(prefix + ".tokens", dtype=np.int32)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths.astype(np.int64))])
        assert self.starts[-1] == len(self.tokens)

    def sequence(self, i):
        return self.tokens[self.starts[i]:self.starts[i + 1]]


class GPTReference:
    """One split of one corpus: the documents repeated per epoch and shuffled, read as one flat token
    stream; window k is stream[k*T : k*T + T + 1], and windows are visited in a shuffled order."""

    def __init__(self, corpus, begin, end, num_samples, seq_length, seed):
        self.corpus = corpus
        self.T = seq_length
        documents = np.arange(begin, end, dtype=np.int32)
        self.tokens_per_epoch = int(corpus.lengths[begin:end].astype(np.int64).sum())
        assert self.tokens_per_epoch >= 2

        # Enough whole epochs for num_samples windows of T + 1 tokens overlapping by one.
        self.epochs = 1
        if num_samples is not None:
            while self.epochs * self.tokens_per_epoch < num_samples * seq_length + 1:
                self.epochs += 1

        # The last epoch is shuffled apart when less than 80% of its windows are needed.
        self.separate = False
        windows_before_last = 0
        if self.epochs > 1:
            windows_before_last = ((self.epochs - 1) * self.tokens_per_epoch - 1) // seq_length
            windows_per_epoch = (self.tokens_per_epoch - 1) // seq_length
            needed_from_last = num_samples - windows_before_last
            assert 0 <= needed_from_last <= windows_per_epoch + 1
            self.separate = needed_from_last < int(0.8 * windows_per_epoch)

        state = np.random.RandomState(seed)

        def epochs_of_documents(n):
            block = np.tile(documents, n).astype(np.int32)
            state.shuffle(block)
            return block

        if self.separate:
            self.document_index = np.concatenate([epochs_of_documents(self.epochs - 1), epochs_of_documents(1)])
        else:
            self.document_index = epochs_of_documents(self.epochs)

        self.num_windows = (self.epochs * self.tokens_per_epoch - 1) // seq_length
        head = windows_before_last if self.separate else self.num_windows
        first = np.arange(0, head, dtype=np.uint32)
        state.shuffle(first)
        parts = [first]
        if head < self.num_windows:
            rest = np.arange(head, self.num_windows, dtype=np.uint32)
            state.shuffle(rest)
            parts.append(rest)
        self.shuffle_index = np.concatenate(parts).astype(np.int64)

        self.stream = np.concatenate([corpus.sequence(d) for d in self.document_index])
        # Where each window starts: (position in document_index, offset in that document).
        ends = np.cumsum(corpus.lengths[self.document_index].astype(np.int64))
        starts = np.arange(self.num_windows + 1, dtype=np.int64) * seq_length
        pos = np.searchsorted(ends, starts, side="right")
        offset = starts - (ends[pos] - corpus.lengths[self.document_index[pos]])
        self.sample_index = np.stack([pos, offset], axis=1).astype(np.int64)

    def __len__(self):
        return self.num_windows

    def window(self, i):
        k = int(self.shuffle_index[i])
        w = self.stream[k * self.T:k * self.T + self.T + 1]
        assert len(w) == self.T + 1
        return w


class BlendReference:
    def __init__(self, parts, weights, size):
        self.parts = parts
        w = np.asarray(normalized(weights), dtype=np.float64)
        drawn = np.zeros(len(parts), dtype=np.int64)
        self.dataset_index = np.zeros(size, dtype=np.int64)
        self.dataset_sample_index = np.zeros(size, dtype=np.int64)
        for i in range(size):
            # The dataset furthest below its share so far (the first one on ties).
            gap = w * max(float(i), 1.0) - drawn.astype(np.float64)
            d = int(np.argmax(gap))
            self.dataset_index[i] = d
            self.dataset_sample_index[i] = drawn[d]
            drawn[d] += 1
        self.size = size

    def __len__(self):
        return self.size

    def window(self, i):
        return self.parts[self.dataset_index[i]].window(int(self.dataset_sample_index[i]))


def blend_from_list(items):
    if len(items) % 2 == 0:
        try:
            weights = [float(items[i]) for i in range(0, len(items), 2)]
            return [items[i + 1] for i in range(0, len(items), 2)], weights
        except ValueError:
            pass
    return list(items), None


def build(case):
    prefixes, weights = blend_from_list(case["data_path"])
    bookends = split_bookends(case["split"])
    which = SPLITS.index(case["which"])
    T, seed, sizes = case["seq_length"], case["seed"], case["num_samples"]
    corpora = {p: Corpus(p) for p in prefixes}

    def part(prefix, n):
        c = corpora[prefix]
        b, e = sequence_range(bookends[which], len(c.lengths))
        return GPTReference(c, b, e, n, T, seed)

    if len(prefixes) == 1 and weights is None:
        return part(prefixes[0], sizes[which])
    if weights is not None:
        w = normalized(weights)
        surplus = case.get("surplus", 0.005)
        planned = [math.ceil(sizes[which] * x) for x in w]
        parts = [part(p, int(math.ceil(n * (1 + surplus)))) for p, n in zip(prefixes, planned)]
        return BlendReference(parts, w, sum(planned))
    parts = [part(p, None) for p in prefixes]
    lengths = [len(q) for q in parts]
    return BlendReference(parts, lengths, min(sizes[which], sum(lengths)))


def main():
    spec = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    checks = []
    for chk in spec.get("split_checks", []):
        bookends = split_bookends(chk["split"])
        rows = []
        for n in chk["sizes"]:
            rows.append([list(sequence_range(b, n)) if b is not None else None for b in bookends])
        checks.append({"split": chk["split"], "ranges": rows})
    json.dump(checks, open(os.path.join(out, "split_checks.json"), "w"))

    for case in spec.get("cases", []):
        ds = build(case)
        name = os.path.join(out, case["name"])
        count = min(case["count"], len(ds))
        np.stack([ds.window(i) for i in range(count)]).astype(np.int32).tofile(name + ".windows")
        meta = {"size": len(ds), "count": count}
        if isinstance(ds, GPTReference):
            meta.update(epochs=[ds.epochs], separate=[ds.separate])
            ds.document_index.astype(np.int64).tofile(name + ".document_index")
            ds.sample_index.tofile(name + ".sample_index")
            ds.shuffle_index.tofile(name + ".shuffle_index")
        else:
            meta.update(epochs=[p.epochs for p in ds.parts], separate=[p.separate for p in ds.parts],
                        part_sizes=[len(p) for p in ds.parts])
            ds.dataset_index[:count].tofile(name + ".dataset_index")
            ds.dataset_sample_index[:count].tofile(name + ".dataset_sample_index")
        json.dump(meta, open(name + ".json", "w"))


if __name__ == "__main__":
    main()
