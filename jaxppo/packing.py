"""Token-budget batching: sequences packed into rows of a fixed token budget instead of padded.

A padded batch (the engine's layout: prompt left-padded to p, response right-padded to r) becomes a
`Packed` batch of micro-batches. Each micro-batch holds one row of at most `budget` tokens per batch
shard; a row is several whole sequences back to back (segment ids 1, 2, ... and positions restarting at 0 for
each; 0 = the unused tail), so attention is block-diagonal and nothing crosses a sequence boundary.
A row's response tokens are laid out flat in `slots` (the vocabulary projection runs on response
tokens only); `gather_idx` says where in the row the state before each one sits, and per-token arrays
(old log-probs, advantages, ...) follow their tokens. Losses, advantages and metrics are computed per
original sequence exactly as without packing (`token_weight` and `seq_count` carry what the
per-sequence aggregation modes need).

Shapes are bucketed so the number of compiled programs stays bounded: the number of micro-batches is
exact up to 8 and then rounded up to a quarter of its power of two (10, 12, 14, 16, 20, ...; empty rows
compute nothing useful: at most ~1/8 is wasted), and so are the number of response-token slots per row
and the number of runs per attention window (its sequences and the unused tail: cuDNN attends within each run).
The row length is a multiple of budget / 8 (at least the longest sequence): of those, the one that
computes the fewest tokens (rows x length) after rounding the rows up, so a batch that would fill
4.4 rows of the budget is packed into 5 shorter rows instead of 5 full-length ones with one nearly
empty. The row count comes from first-fit decreasing (the longest first, each into the first row with
room); the sequences are then spread over those rows so each holds about the same number of response
tokens (the slots are the most any row holds), unless that does not fit or is not better. Every batch
shard gets one row per micro-batch.

Within a run, rows hold no more than the memory plan compiled for (`Caps`: slots, row length, runs; the plan's
worst case at the budget): a batch of many short sequences gets more rows rather than a row with more runs or
slots than any program measured (cuDNN's packed attention keeps float32 statistics of [rows x runs, heads, row
length], so a program's memory grows with its runs).

Attention windows (`window`: the longest sequence there can be, the model's `attention_window`): cuDNN's packed
layout is a batch of (rows x runs) sequences, each up to the row's length, and its kernels are gridded over that
whether a run is short or empty (the likely reason an update's backward at 0.5B spent ~1 ms a layer in one cuDNN
kernel for ~22k tokens: docs/benchmarks.md, "cuDNN's packed attention cut into windows"). So a row is cut into `k`
equal windows no shorter than the longest sequence, of one length at a budget (`window_length`,
`attention_windows`), and its runs are listed by the window they start in (`segment_starts` [.., k, runs]; a
sequence may run on into the next window, the unused tail is cut at each window's start): cuDNN then sees (rows x k
x runs) sequences of at most the window's length, k times fewer columns each and far fewer runs. The runs count of
a shape is then per window, and caps no row's sequences (a window holds at most window / shortest sequence of them
whatever the row).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ROW_STEPS = 8  # row lengths are multiples of budget / ROW_STEPS
REUSE_SLACK = 0.25  # a shape compiled before is reused when it computes at most this much more than the best

# per-token arrays of the padded layout that follow their sequence into its slot
SEQ_KEYS = ("old_logprobs", "advantages", "ref_logprobs", "is_weights", "values", "returns")


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def bucket(n: int) -> int:
    """`n` itself up to 8, then rounded up to a quarter of its power of two (9 -> 10, 17 -> 20, 33 -> 40):
    at most ~1/8 wasted, four compiled shapes per doubling."""
    if n <= 8:
        return max(int(n), 1)
    step = _pow2(n) // 8
    return -(-int(n) // step) * step


def buckets_upto(n: int) -> list[int]:
    out, k = [], 1
    while True:
        out.append(bucket(k))
        if out[-1] >= n:
            return sorted(set(out))
        k = out[-1] + 1


@dataclasses.dataclass
class Packed:
    """Host arrays with a leading micro-batch axis, one row per batch shard:
      input_ids, attention_mask (segment ids), positions   [n_micro, shards, row length]
      gather_idx       [n_micro, shards, slots]  in-row position of the state before each response token
      targets, response_mask, token_weight, slot_segment and the SEQ_KEYS arrays   [n_micro, shards, slots]
      seq_count        [n_micro, shards]          sequences with a response token in each row
      segment_starts   [n_micro, shards, k, runs] start column in the row of each run of equal segment ids (the
                                                  sequences, then the unused tail cut at each window's start), by
                                                  the window it starts in (k windows; 1 without `window`), -1 after
                                                  a window's last
    Response tokens are laid flat (`slots` per row, the row's response tokens first, then padding), so
    the vocabulary projection runs on response tokens only. `token_weight` is 1 / (the token's sequence's
    response length), what `seq-mean-token-mean` needs when rows are not sequences."""

    arrays: dict[str, np.ndarray]
    slot_seq: np.ndarray  # [n_micro * shards, slots] padded-batch row of each slot (-1: empty)
    slot_pos: np.ndarray  # [n_micro * shards, slots] its response position j
    members: list[list[int]]  # padded-batch rows of each packed row, in row order
    response_length: int

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        """(micro-batches, slots per row, row length, runs per window): what a compiled program depends on (the
        windows follow from the row length)."""
        a = self.arrays
        runs = a["segment_starts"].shape[-1]
        return a["gather_idx"].shape[0], a["gather_idx"].shape[2], a["input_ids"].shape[2], runs

    def unpack(self, x: np.ndarray, batch_size: int) -> np.ndarray:
        """[n_micro, shards, slots] per-slot outputs -> [batch_size, r] in the padded batch's layout."""
        x = np.asarray(x).reshape(self.slot_seq.shape + np.shape(x)[3:])
        out = np.zeros((batch_size, self.response_length) + x.shape[2:], x.dtype)
        sel = self.slot_seq >= 0
        out[self.slot_seq[sel], self.slot_pos[sel]] = x[sel]
        return out

    @property
    def useful_tokens(self) -> int:
        return int((self.arrays["attention_mask"] > 0).sum())


@dataclasses.dataclass(frozen=True)
class Caps:
    """The most a packed row may hold: the shape the memory plan compiled (slots, row length, runs), so that every
    program a run compiles is no larger in any of them than the one the plan measured (more rows instead). `runs`
    caps a row's sequences only in a row of one window (0: no cap, `_row_caps`)."""

    slots: int
    row_len: int
    runs: int

    @classmethod
    def of(cls, shape_key: tuple[int, int, int, int]) -> "Caps":
        return cls(slots=shape_key[1], row_len=shape_key[2], runs=shape_key[3])


def first_fit_decreasing(lengths: np.ndarray, budget: int, responses: np.ndarray | None = None,
                         caps: Caps | None = None) -> list[list[int]]:
    """Bins (lists of indices) of total length <= budget; the longest sequences are placed first. `caps`: each
    bin also holds at most caps.slots response tokens (`responses`) and caps.runs - 1 sequences (a run is left
    for the unused tail)."""
    bins: list[list[int]] = []
    room: list[int] = []
    resp: list[int] = []
    most_seqs = caps.runs - 1 if caps and caps.runs else None
    for i in sorted(range(len(lengths)), key=lambda k: -int(lengths[k])):
        n = int(lengths[i])
        r = int(responses[i]) if caps else 0
        for b, free in enumerate(room):
            if n <= free and (caps is None or ((most_seqs is None or len(bins[b]) < most_seqs)
                                               and resp[b] + r <= caps.slots)):
                bins[b].append(i)
                room[b] -= n
                resp[b] += r
                break
        else:
            bins.append([i])
            room.append(budget - n)
            resp.append(r)
    return bins


def balance_responses(lengths: np.ndarray, responses: np.ndarray, n_rows: int, capacity: int,
                      caps: Caps | None = None) -> list[list[int]] | None:
    """Bins for exactly `n_rows` rows of `capacity` tokens that spread the response tokens evenly (the
    vocabulary projection runs on the most a row holds): longest sequence first, each into the row with
    the fewest response tokens that has room (`caps`: and fewer than caps.runs - 1 sequences so far). None if a
    sequence finds no room."""
    bins: list[list[int]] = [[] for _ in range(n_rows)]
    room, resp = [capacity] * n_rows, [0] * n_rows
    most_seqs = caps.runs - 1 if caps and caps.runs else len(lengths)
    for i in sorted(range(len(lengths)), key=lambda k: (-int(lengths[k]), -int(responses[k]))):
        fits = [r for r in range(n_rows) if room[r] >= lengths[i] and len(bins[r]) < most_seqs]
        if not fits:
            return None
        r = min(fits, key=lambda r: (resp[r], -room[r]))
        bins[r].append(i)
        room[r] -= int(lengths[i])
        resp[r] += int(responses[i])
    return bins


def window_length(budget: int, longest: int | None) -> int | None:
    """The length of the attention windows of every packed row at a token budget: the shortest divisor of the rows'
    unit (budget / ROW_STEPS: every row length a multiple of it) that holds the longest sequence, the same for every
    row, so a shorter row's windows hold no more runs than the plan's; None (rows of one window) without `longest`,
    for a budget not a multiple of ROW_STEPS, or a unit shorter than the longest sequence."""
    if not longest or budget % ROW_STEPS:
        return None
    unit = budget // ROW_STEPS
    return next((d for d in range(longest, unit + 1) if unit % d == 0), None)


def attention_windows(width: int, budget: int, longest: int | None) -> int:
    """The windows a packed row of `width` columns at `budget` is cut into for cuDNN's packed attention: of
    `window_length` each, when they divide it into two or more; else 1."""
    w = window_length(budget, longest)
    return width // w if w and width % w == 0 and width >= 2 * w else 1


def _row_caps(caps: Caps | None, width: int, budget: int, window: int | None) -> Caps | None:
    """`caps` for rows of `width` columns: in a row of several attention windows `runs` is a window's count and caps
    no row's sequences."""
    if caps is not None and attention_windows(width, budget, window) > 1:
        return dataclasses.replace(caps, runs=0)
    return caps


def window_starts(lengths: list[int], width: int, k: int) -> list[list[int]]:
    """Each of a row's `k` windows' run starts: the sequences of `lengths` laid back to back from column 0, then the
    unused tail, cut where each window starts (a run longer than a window would leave columns unattended)."""
    w = width // k
    out: list[list[int]] = [[] for _ in range(k)]
    off = 0
    for n in lengths:
        out[off // w].append(off)
        off += n
    while off < width:
        out[off // w].append(off)
        off = (off // w + 1) * w
    return out


def row_lengths(budget: int) -> list[int]:
    """The row lengths `pack` may choose for a token budget, longest first."""
    return sorted({-(-budget * k // ROW_STEPS) for k in range(1, ROW_STEPS + 1)}, reverse=True)


def _layout(lengths: np.ndarray, budget: int, shards: int, min_micro: int, row_len: int | None,
            known: frozenset = frozenset(), responses: np.ndarray | None = None, caps: Caps | None = None,
            window: int | None = None) -> tuple[list[list[int]], int, int]:
    """(bins, micro-batches, row length) computing the fewest tokens (the longer row wins a tie), unless a
    (micro-batches, row length) already compiled (`known` shape keys) computes at most REUSE_SLACK more: then
    that one, so that batches of slightly different sizes do not each compile a program of their own. `caps`:
    rows no longer than caps.row_len, and within its slots and runs."""
    longest = int(lengths.max(initial=1))
    candidates = []
    lengths_allowed = [n for n in row_lengths(budget) if n >= longest and (caps is None or n <= caps.row_len)]
    for length in [row_len] if row_len else lengths_allowed:
        bins = first_fit_decreasing(lengths, length, responses, _row_caps(caps, length, budget, window))
        n_micro = max(bucket(math.ceil(len(bins) / shards)), min_micro)
        candidates.append((n_micro * length, -length, n_micro, bins))
    cost, neg_len, n_micro, bins = min(candidates, key=lambda c: c[:2])
    reuse = [(n * -nl, nl, n, bs) for c, nl, m, bs in candidates for (n, _, w, _) in known
             if w == -nl and n >= m and n * w <= (1 + REUSE_SLACK) * cost]
    if reuse:
        cost, neg_len, n_micro, bins = min(reuse, key=lambda c: c[:2])
    return bins, n_micro, -neg_len


def _reuse(value: int, index: int, known: frozenset, n_micro: int, width: int) -> int:
    """The smallest slots / runs count (`index` 1 / 3 of a shape key) of a compiled shape with this micro-batch
    count and row length that holds `value` within REUSE_SLACK of its bucket (slots: or within a quarter of the row
    length more, the vocabulary projection of that many tokens being a small part of the row's work, far less than a
    compile; runs: any, an empty run computing nothing); else the bucket itself."""
    target = bucket(value)
    most = (1 + REUSE_SLACK) * target
    if index == 1:
        most = max(most, value + width * REUSE_SLACK)
    elif index == 3:
        most = float("inf")
    fits = [k[index] for k in known if k[0] == n_micro and k[2] == width and value <= k[index] <= most]
    return min(fits) if fits else target


def pack(batch: dict[str, np.ndarray], response_length: int, budget: int, shards: int,
         what: str = "actor.ppo_max_token_len_per_device", min_micro: int = 1, min_slots: int = 1,
         row_len: int | None = None, min_runs: int = 1, known: frozenset | set = frozenset(),
         caps: Caps | None = None, window: int | None = None) -> Packed:
    """Pack a padded host batch (see jaxppo/engine.py for the layout) into rows of at most `budget`
    tokens (`row_len`: exactly that long; min_*, row_len: what other processes need; `known`: shape keys of
    programs compiled already, reused when they cost little more; `caps`: the most a row may hold, the shape the
    memory plan compiled: more rows rather than a larger row; `window`: the longest sequence any batch of the run
    has, which sets the rows' attention windows, `attention_windows`)."""
    ids, seg = np.asarray(batch["input_ids"]), np.asarray(batch["attention_mask"])
    r = response_length
    b, t = ids.shape
    p = t - r
    valid = seg > 0
    lengths = valid.sum(1)
    too_long = np.nonzero(lengths > budget)[0]
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"sequence {i} has {int(lengths[i])} tokens, more than {what} = {budget}")
    known = frozenset(known)
    rmask = np.asarray(batch["response_mask"]) > 0
    rlen = rmask.sum(1)
    if caps is not None and (int(lengths.max(initial=1)) > caps.row_len or int(rlen.max(initial=0)) > caps.slots
                             or caps.runs < 2):
        caps = None  # a sequence the planned shape cannot hold at all: a larger program (the late-compile check)
    if window:  # no sequence longer than a window
        window = max(window, int(lengths.max(initial=0)))
    bins, n_micro, width = _layout(lengths, budget, shards, min_micro, row_len, known, rlen, caps, window)
    bins += [[] for _ in range(n_micro * shards - len(bins))]
    most = lambda bs: max(1, max(int(rlen[m].sum()) for m in bs))  # noqa: E731
    # the same rows, fewer slots if it fits
    even = balance_responses(lengths, rlen, len(bins), width, _row_caps(caps, width, budget, window))
    if even is not None and most(even) < most(bins):
        bins = even
    # runs of a row by window: its sequences, then the unused tail (if any), cut at each window's start; one
    # window: an empty row is one run
    k = attention_windows(width, budget, window)
    runs_of = [window_starts([int(lengths[i]) for i in m], width, k) for m in bins]
    n_runs = max(len(w) for row in runs_of for w in row)
    slots = max(_reuse(most(bins), 1, known, n_micro, width), min_slots)
    # several windows: at least two runs each (with one, cuDNN's layout drops the offsets: a run would start at
    # its window's first column)
    fewest_runs = 2 if k > 1 else 1
    runs = max(_reuse(n_runs, 3, known, n_micro, width), min_runs, fewest_runs)
    if caps is not None:  # a bucket above the planned shape: the planned count holds the rows as well
        slots, runs = max(min(slots, caps.slots), most(bins)), max(min(runs, caps.runs), n_runs, fewest_runs)
    rows = n_micro * shards
    starts = np.full((rows, k, runs), -1, np.int32)
    for row, windows in enumerate(runs_of):
        for j, w in enumerate(windows):
            starts[row, j, :len(w)] = w

    out_ids, out_seg, out_pos = (np.zeros((rows, width), np.int32) for _ in range(3))
    gather, targets = np.zeros((rows, slots), np.int32), np.zeros((rows, slots), np.int32)
    slot_mask, weight = np.zeros((rows, slots), np.float32), np.zeros((rows, slots), np.float32)
    slot_segment = np.zeros((rows, slots), np.int32)  # the slot's sequence within its row (1, 2, ...; 0: empty)
    slot_seq, slot_pos = np.full((rows, slots), -1, np.int64), np.zeros((rows, slots), np.int64)
    seq_count = np.zeros(rows, np.float32)
    per_tok = {k: np.zeros((rows, slots), np.asarray(batch[k]).dtype) for k in SEQ_KEYS if k in batch}
    # token k of a sequence's valid run is its k-th valid column (prompts left-padded, responses
    # right-padded); the state before response token j is valid token n_prompt - 1 + j
    for row, members in enumerate(bins):
        off, slot = 0, 0
        for s, i in enumerate(members):
            cols = np.nonzero(valid[i])[0]
            n = cols.size
            out_ids[row, off:off + n] = ids[i, cols]
            out_seg[row, off:off + n] = s + 1
            out_pos[row, off:off + n] = np.arange(n)
            n_prompt = int((cols < p).sum())
            js = np.nonzero(rmask[i])[0]
            k = slice(slot, slot + js.size)
            gather[row, k] = off + n_prompt - 1 + js
            targets[row, k] = ids[i, p + js]
            slot_mask[row, k], weight[row, k] = 1.0, 1.0 / max(js.size, 1)
            slot_segment[row, k] = s + 1
            slot_seq[row, k], slot_pos[row, k] = i, js
            for key in per_tok:
                per_tok[key][row, k] = batch[key][i, js]
            seq_count[row] += js.size > 0
            off, slot = off + n, slot + js.size
    shaped = lambda x: x.reshape((n_micro, shards) + x.shape[1:])  # noqa: E731
    arrays = {"input_ids": shaped(out_ids), "attention_mask": shaped(out_seg), "positions": shaped(out_pos),
              "gather_idx": shaped(gather), "targets": shaped(targets), "response_mask": shaped(slot_mask),
              "token_weight": shaped(weight), "seq_count": shaped(seq_count), "slot_segment": shaped(slot_segment)}
    arrays["segment_starts"] = shaped(starts)
    arrays.update({k: shaped(v) for k, v in per_tok.items()})
    return Packed(arrays, slot_seq, slot_pos, bins, r)


def max_programs(batch_size: int, budget: int, shards: int) -> int:
    """Bound on the distinct (micro-batches, slots, row length, runs) shapes `pack` can produce for batches
    of `batch_size` sequences: the buckets up to the worst case of each."""
    return (len(buckets_upto(math.ceil(batch_size / shards))) * len(buckets_upto(budget)) * len(row_lengths(budget))
            * len(buckets_upto(batch_size + 1)))


__all__ = ["Packed", "Caps", "pack", "first_fit_decreasing", "balance_responses", "max_programs", "row_lengths",
           "attention_windows", "window_length", "window_starts", "SEQ_KEYS"]
