"""One step's model inputs, packed on the host into persistent buffers and sent in one copy.

Every step needs the same handful of small tensors (token ids, positions, KV slots, the rows that
sample, query starts, sequence lengths, block tables, and for a step with prompt tokens the
prefill kernel's work list). Building each with its own numpy array, ``pin_memory()`` and copy
cost about a millisecond a step on the host, more than a small model's decode step on the GPU.
Here they are laid out back to back in one byte buffer that lives for the engine's life: the host
fills it with a few vectorised numpy operations (a few comprehensions read the requests' fields;
no numpy array per request), one ``non_blocking`` copy moves the used prefix to the device, and
the device tensors are views into the device buffer.

Host buffers are pinned on CUDA (so the copy is truly asynchronous) and used in a ring: the copy
of step N may still be queued behind the GPU's work when the host packs step N+1, so step N+1
writes another buffer, and a buffer is reused only after the event recorded behind its copy has
completed. The single device buffer needs no ring: the next step's copy is enqueued on the same
stream after every kernel that reads this step's views.

Rows whose last input token is still on the device (a placeholder, with overlap) get their id
from the previous step's sampled tensor with one gather on the device.

A steady decode step (the same requests as the step before, in the same order, one token each,
every one a placeholder for the id its row sampled last step) is not packed anew: the last
step's buffer is copied and advanced by one token, and only the rows that enter a new KV block
read their block table again (``_advance``). Its bytes are the ones a full pack would write.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine_core.attention.base import (
    SHARED_PREFIX_MIN_ROWS,
    AttentionMetadata,
    shared_prefix_tokens,
)
from engine_core.attention.prefill_tiles import capacity, prefill_block_m, tile_list
from engine_core.request import Request, ScheduledRequest, SchedulerOutput
from engine_core.step_stats import GpuTimeline

_RING = 3  # host buffers in flight: the one being packed, and up to two queued copies
# Layouts kept for reuse (a steady decode repeats a handful of shapes); past this, start over.
_MAX_LAYOUTS = 256
# A step's layout gives the block tables room for the widest table rounded up to whole
# TABLE_ROOM blocks (InputBatch._room), so a steady decode whose tables grow by a block keeps
# its layout and advances (``_advance``) instead of packing in full; the attention metadata
# still gets tables as wide as the widest (the eager decode kernel sizes its splits by it).
# Timed on the engine's host code alone: the step in which 64 requests each enter a new block
# packed in 117 us this way, against 272 us packed in full (256 requests: 242 against 500;
# docs/design/cuda-graphs-and-warm-up.md, "Staging and the input batch").
TABLE_ROOM = 8


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the last row of each sequence that samples
    sampling_requests: list[Request]
    sample_ends: np.ndarray  # [S] int64: where each sampling row's chunk ends (its seq_len)
    # A steady decode step whose every token is a placeholder for the id its row sampled last
    # step: those ids [T], not yet in input_ids. The forward takes them (model_runner.py
    # ModelRunner._forward): the decode graph's staging launch reads them in place of
    # input_ids, any other forward copies them in first.
    ids_from: torch.Tensor | None = None
    # With more than one KV layer group: every group's metadata, ``meta`` (group 0's) first,
    # each with its own block tables and slot mapping; empty with one group.
    group_metadata: tuple[AttentionMetadata, ...] = ()

    def output_positions(self) -> list[int]:
        """[S]: which output of its request each sampling row draws. Computed when asked: the
        sampler needs them only for rows that do more than take the argmax."""
        prompts = [r.num_prompt_tokens for r in self.sampling_requests]
        return (self.sample_ends - np.array(prompts, dtype=np.int64)).tolist()


@dataclass
class _SteadyStep:
    """The last packed step (its layout and ring buffer: InputBatch._last) where the next one
    can advance it (InputBatch._advance): every row took one placeholder token, sampled, and
    had its id from the same row last step."""

    requests: list[Request]  # its rows, the list returned as its sampling requests
    sample_ends: np.ndarray  # [B] int64: each row's seq_len


class InputBatch:
    """Persistent host (pinned on CUDA) and device buffers, and the packing of one step."""

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        kv_windows: Sequence[int | None] = (None,),
        kv_attention_chunks: Sequence[int | None] = (),
        mark_uniform: bool = False,
        orders_rows: bool = False,
    ) -> None:
        """``kv_windows``: the window of each of the model's KV layer groups (None: full
        attention; engine_core/kv_groups.py), each with its own block tables and slot mapping
        in the step; ``kv_attention_chunks``: each group's attention chunk (empty: none).
        ``mark_uniform``: mark a step whose sequences all have the same few new tokens
        (``AttentionMetadata.uniform_query_len``: a speculating engine's verify steps), which
        the Triton backend then attends with its verify kernel; off, every step is attended
        as before (a plain engine's equal prompt chunks compile no verify kernel mid-serving).
        ``orders_rows``: give a decode-only step its row order (AttentionMetadata.row_order),
        for a backend that launches by it (the Triton backend's decode kernel)."""
        self.device = device
        self.mark_uniform = mark_uniform
        self.orders_rows = orders_rows
        self.block_size = block_size
        self.kv_windows = tuple(kv_windows)
        self.kv_attention_chunks = tuple(c for c in kv_attention_chunks if c is not None)
        self.num_groups = len(self.kv_windows)
        self._max_width = max_blocks_per_seq
        self._pinned = device.type == "cuda"
        # The engine's one stream (its copies' events record on it): looked up once, as each
        # lookup costs the host microseconds a step.
        self._stream = torch.cuda.current_stream(device) if self._pinned else None
        self._capacity = _packed_bytes(
            max_num_tokens,
            max_num_seqs,
            max_num_seqs,
            max_num_seqs,
            max_blocks_per_seq,
            capacity(max_num_tokens, max_num_seqs, prefill_block_m(max_num_tokens)),
            self.num_groups,
        )
        self._next = 0
        # The last packed step's layout, ring buffer and widest block table (``last_step``).
        self._last: tuple[_Layout, int, int] | None = None
        # Layouts by their counts, with their views of the device buffer (``_layout``).
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        self._steady: _SteadyStep | None = None  # the last step, where the next can advance it
        # The shared-prefix tokens of the last step packed (AttentionMetadata.shared_prefix),
        # for the profiler's step shapes (engine_core/profiler.py).
        self.shared_tokens = 0
        # A steady decode step advances the last step's buffer instead of packing anew; False
        # packs every step in full, the reference the tests and bench_host_step.py compare with.
        self.advance_steady = True
        self._allocate(self._capacity)
        # The runner's GPU timing of the next step (step stats), or None: the input copy and
        # the placeholder gather are its first stretch.
        self.timeline: GpuTimeline | None = None

    def _allocate(self, nbytes: int) -> None:
        ring = _RING if self._pinned else 1
        self._host_tensors = [
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned) for _ in range(ring)
        ]
        self._host = [t.numpy() for t in self._host_tensors]
        self._copied: list[torch.cuda.Event | None] = [None] * ring
        self._device_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._capacity = nbytes
        self._layouts.clear()  # their views are of the old device buffer
        self._steady = None  # its host buffer is gone

    def _layout(self, *counts: int) -> _Layout:
        """The layout of a step of these counts: made once, then reused with its device views
        (building them costs some twenty tensor calls a step on the host)."""
        layout = self._layouts.get(counts)
        if layout is None:
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[counts] = _Layout(*counts)
        return layout

    def pack(
        self,
        plan: SchedulerOutput,
        prev_sampling: Sequence[Request],
        prev_sampled: torch.Tensor | None,
    ) -> PackedInputs:
        """Flatten ``plan`` into device tensors; placeholder ids come from ``prev_sampled``.

        ``prev_sampled`` [S_prev] holds the previous step's sampled ids, still on the device:
        row i is ``prev_sampling[i]``'s.
        """
        # The requests' fields into flat lists of Python ints (one comprehension each: cheaper
        # than one loop of appends), then numpy on the whole batch: no numpy array per request.
        scheduled = plan.scheduled
        requests = [s.request for s in scheduled]
        steady = self._steady
        self._steady = None  # set again below where this step can be advanced in turn
        if (
            steady is not None
            and plan.decode_only
            and prev_sampled is not None
            and prev_sampling is steady.requests  # the runner's last step is that one
            and requests == prev_sampling  # the same rows in the same order (identity, in C)
        ):
            advanced = self._advance(steady, plan, requests, prev_sampled)
            if advanced is not None:
                return advanced
        starts = [s.start for s in scheduled]
        lens = [s.num_new_tokens for s in scheduled]
        widths = [len(s.block_ids) for s in scheduled]
        tables = array.array("i")
        for s in scheduled:
            tables.extend(s.block_ids)  # a memcpy for the block manager's int32 arrays
        if self.num_groups > 1:
            tables = self._group_tables(scheduled, tables)
        samples = [s.samples for s in scheduled]
        # A steady decode step samples every row: the lists below are then the step's own.
        sample_seqs = None if all(samples) else [i for i, s in enumerate(samples) if s]
        if len(requests) == sum(lens):  # decode only: one token each
            tokens = [r.token_ids[start] for r, start in zip(requests, starts, strict=True)]
        else:
            tokens = list(
                chain.from_iterable(
                    r.token_ids[start : start + n]
                    for r, start, n in zip(requests, starts, lens, strict=True)
                )
            )
        sampling = requests if sample_seqs is None else [requests[i] for i in sample_seqs]
        return self._fill(
            tokens, tables, starts, lens, widths, sample_seqs, requests, prev_sampling,
            prev_sampled, sampling,
        )  # fmt: skip

    def _group_tables(
        self, scheduled: Sequence[ScheduledRequest], main: array.array
    ) -> list[array.array]:
        """Every group's tables flattened, group 0's (``main``) first. A row planned without
        group tables (the warm-up's) uses group 0's ids in every group."""
        out = [main]
        for group in range(1, self.num_groups):
            flat = array.array("i")
            for s in scheduled:
                flat.extend(s.group_block_ids[group - 1] if s.group_block_ids else s.block_ids)
            if len(flat) != len(main):
                raise ValueError(f"KV group {group}'s block tables differ from group 0's in size")
            out.append(flat)
        return out

    def _fill(
        self,
        token_list: list[int],
        tables: array.array | list[array.array],
        start_list: list[int],
        len_list: list[int],
        width_list: list[int],
        sample_seqs: list[int] | None,
        requests: list[Request],
        prev_sampling: Sequence[Request],
        prev_sampled: torch.Tensor | None,
        sampling: list[Request],
    ) -> PackedInputs:
        # Each numpy call costs microseconds whatever its size, so the decode-only batch (one
        # token per sequence) takes shortcuts, and maxima of short lists are taken in Python.
        starts = np.array(start_list, dtype=np.int64)  # [B]
        lens = np.array(len_list, dtype=np.int64)  # [B]
        tokens = np.array(token_list, dtype=np.int64)  # [T]
        num_seqs, num_tokens, num_sampling = len(starts), len(tokens), len(sampling)
        decode_only = num_tokens == num_seqs
        if decode_only:
            query_start = np.arange(num_seqs + 1, dtype=np.int64)  # [B + 1]
        else:
            query_start = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(lens, out=query_start[1:])
        last = query_start[1:] - 1  # [B] the token row of each sequence's last token
        # Placeholders (ids still on the device) can only be the last token of a chunk.
        waiting = np.flatnonzero(tokens[last] < 0)  # [G] sequence indices
        gather_dst = last[waiting]  # [G] token rows
        gather_src = _prev_rows_of(prev_sampling, requests, waiting)
        num_gather, width = len(waiting), max(width_list)
        room = self._room(width)
        # The Triton prefill kernel's work list (attention/prefill_tiles.py); decodes need none.
        tiles = None if decode_only else tile_list(len_list, prefill_block_m(num_tokens))
        num_tiles = 0 if tiles is None else len(tiles)
        layout = self._layout(
            num_tokens, num_seqs, num_sampling, num_gather, room, num_tiles, self.num_groups
        )
        host = self._host_buffer(layout.nbytes)
        view = layout.host_views(host)  # section name -> its view of the host buffer
        seq_lens = starts + lens  # [B]
        if decode_only:
            seq_of_token = np.arange(num_seqs)
            positions = starts
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), lens)  # [T]
            positions = np.arange(num_tokens) + np.repeat(starts - query_start[:-1], lens)
        group_tables = [tables] if isinstance(tables, array.array) else tables
        block_tables = view["block_tables"].reshape(num_seqs, room)  # [B, room] int32
        _fill_tables(block_tables, group_tables[0], width_list, width)
        bs = self.block_size
        view["input_ids"][:] = tokens
        view["positions"][:] = positions
        slots = view["slot_mapping"]
        np.multiply(block_tables[seq_of_token, positions // bs].astype(np.int64), bs, out=slots)
        slots += positions % bs
        if len(group_tables) > 1:
            more_tables = view["group_block_tables"].reshape(-1, num_seqs, room)  # [G-1, B, room]
            more_slots = view["group_slot_mapping"].reshape(-1, num_tokens)  # [G-1, T]
            for flat, table, group_slots in zip(
                group_tables[1:], more_tables, more_slots, strict=True
            ):
                _fill_tables(table, flat, width_list, width)
                np.multiply(table[seq_of_token, positions // bs], bs, out=group_slots)
                group_slots += positions % bs
        # Every sequence samples in a steady decode batch: sample_seqs is then 0..B-1.
        view["logits_indices"][:] = last if sample_seqs is None else last[sample_seqs]
        view["gather_dst"][:] = gather_dst
        view["gather_src"][:] = gather_src
        view["query_start_loc"][:] = query_start
        view["seq_lens"][:] = seq_lens
        if tiles is not None:
            view["prefill_tiles"][:] = tiles.reshape(-1)
        if decode_only and self.orders_rows:  # longest first (AttentionMetadata.row_order)
            view["row_order"][:] = np.argsort(-seq_lens, kind="stable")
        shared = self._shared_prefix(block_tables, seq_lens, lens, decode_only)
        view["shared_prefix"][:] = shared
        self.shared_tokens = shared[0]  # a steady step that follows keeps them (_advance)
        self._last = layout, self._next, width
        sample_ends = seq_lens if sample_seqs is None else seq_lens[sample_seqs]
        # Every token is the one its row sampled last step, row for row (a steady decode).
        in_order = decode_only and gather_src is waiting and num_gather == num_seqs
        if in_order and sample_seqs is None and self.advance_steady:
            self._steady = _SteadyStep(sampling, sample_ends)
        return self._upload(layout, host, prev_sampled, sampling, sample_ends, in_order, width)

    def _shared_prefix(
        self, tables: np.ndarray, seq_lens: np.ndarray, lens: np.ndarray, decode_only: bool
    ) -> tuple[int, int]:
        """The step's shared-prefix tokens (base.shared_prefix_tokens) over its one-token
        sequences, the ones the decode kernel attends (in a step with prompt rows too), and
        the first of them. One KV group only: other groups' tables (windows, chunks) hold
        other pages."""
        if self.num_groups != 1:
            return 0, 0
        if decode_only:
            return shared_prefix_tokens(tables, seq_lens, self.block_size), 0
        rows = np.flatnonzero(lens == 1)
        if len(rows) < SHARED_PREFIX_MIN_ROWS:  # before copying their tables
            return 0, 0
        tokens = shared_prefix_tokens(tables[rows], seq_lens[rows], self.block_size)
        return (tokens, int(rows[0])) if tokens else (0, 0)

    def _room(self, width: int) -> int:
        """The block tables' width in the layout of a step whose widest table has ``width``
        blocks: rounded up to whole TABLE_ROOM blocks, within max_blocks_per_seq."""
        return max(width, min(-(-width // TABLE_ROOM) * TABLE_ROOM, self._max_width))

    def _advance(
        self,
        last: _SteadyStep,
        plan: SchedulerOutput,
        requests: list[Request],
        prev_sampled: torch.Tensor,
    ) -> PackedInputs | None:
        """The step after ``last`` when it decodes the same rows: each row's position, length
        and KV slot move on by one token, and a row whose token starts a new block takes the
        block's id from its table (a block table only grows, by a block at a time, as its last
        block fills). None where a table outgrows the layout's room (the layout changes), or
        did not grow by just that block: then the step is packed in full. The ids and sampling
        rows are the last step's."""
        assert self._last is not None, "a steady step is always the last one packed"
        layout, ring, width = self._last
        bs = self.block_size
        last_host = self._host[ring]
        positions = layout.host_views(last_host)["positions"] + 1  # [B]
        entering = np.flatnonzero(positions % bs == 0)  # rows whose token starts a block
        cols = positions[entering] // bs  # that block's place in the row's table
        scheduled = plan.scheduled
        tables = [scheduled[row].block_ids for row in entering.tolist()]
        # A table past the layout's room changes the layout; one that did not grow by just the
        # entered block would break the growth rule above (not seen; packed in full, whatever
        # the cause).
        wanted = zip(tables, cols.tolist(), strict=True)
        if any(len(table) != col + 1 or col >= layout.width for table, col in wanted):
            return None
        if self.num_groups > 1 and not all(s.group_block_ids for s in scheduled):
            return None  # a row planned without its groups' tables: packed in full
        if any(np.any(positions % chunk == 0) for chunk in self.kv_attention_chunks):
            # A row entering a new attention chunk: its chunked groups gave back every block
            # before the chunk (many entries at once, in group 0 too where it is chunked), so
            # this step, once every C steps of a row, is packed in full.
            return None
        host = self._host_buffer(layout.nbytes)
        if host is not last_host:  # a ring of one (no pinned memory) advances in place
            host[: layout.nbytes] = last_host[: layout.nbytes]
        view = layout.host_views(host)
        view["positions"][:] = positions
        view["seq_lens"] += 1
        slots = view["slot_mapping"]
        slots += 1
        if self.num_groups > 1:
            self._advance_groups(view, layout, entering, cols, scheduled)
        if tables:
            # Each entered block is its table's last; the columns before it are as they were.
            entered = np.array([table[-1] for table in tables], dtype=np.int32)
            block_tables = view["block_tables"].reshape(layout.counts[1], layout.width)
            block_tables[entering, cols] = entered
            slots[entering] = entered.astype(np.int64) * bs
            width = max(width, int(cols.max()) + 1)
        self._last = layout, self._next, width
        sample_ends = last.sample_ends + 1
        self._steady = _SteadyStep(requests, sample_ends)
        return self._upload(layout, host, prev_sampled, requests, sample_ends, True, width)

    def _advance_groups(
        self,
        view: dict[str, np.ndarray],
        layout: _Layout,
        entering: np.ndarray,
        cols: np.ndarray,
        scheduled: list[ScheduledRequest],
    ) -> None:
        """``_advance`` for groups 1..: every slot moves on by one; each row entering a block
        (``entering``, at column ``cols``) takes each group's new last block; and in a window
        group, each row whose window start crossed into a new block takes the entry before it
        from its table (the block manager gave that block back when it planned this step: the
        null block now), so the bytes stay those of a full pack."""
        num_tokens, num_seqs = layout.counts[:2]
        more_slots = view["group_slot_mapping"].reshape(-1, num_tokens)  # [G-1, T]
        more_slots += 1
        bs = self.block_size
        positions = view["positions"]  # [B]: the step's, one token each
        more_tables = view["group_block_tables"].reshape(-1, num_seqs, layout.width)
        for group in range(1, self.num_groups):
            tables = more_tables[group - 1]
            if len(entering):
                ids = [scheduled[row].group_block_ids[group - 1][-1] for row in entering.tolist()]
                block_ids = np.array(ids, dtype=np.int32)
                tables[entering, cols] = block_ids
                more_slots[group - 1][entering] = block_ids.astype(np.int64) * bs
            window = self.kv_windows[group]
            if window is not None:
                start = positions - (window - 1)  # [B]: each row's window start
                left = np.flatnonzero((start > 0) & (start % bs == 0))
                given_back = start[left] // bs - 1
                tables[left, given_back] = [
                    scheduled[row].group_block_ids[group - 1][col]
                    for row, col in zip(left.tolist(), given_back.tolist(), strict=True)
                ]

    def last_step(self) -> tuple[tuple[int, ...], bytes]:
        """The last packed step as ``unpack`` rebuilds it on another tensor-parallel rank: its
        layout's counts followed by its widest block table, and its host bytes (every field but
        the placeholders' ids, which each rank gathers from its own copy of the previous step's
        sampled ids)."""
        assert self._last is not None, "no step packed yet"
        layout, ring, width = self._last
        return (*layout.counts, width), self._host[ring][: layout.nbytes].tobytes()

    def unpack(
        self, counts: tuple[int, ...], data: bytes, prev_sampled: torch.Tensor | None
    ) -> PackedInputs:
        """Another rank's ``last_step`` as this rank's device tensors (no sampling rows: only
        rank 0 samples)."""
        self._steady = None  # the ring buffer written below may be the one it advances
        *layout_counts, width = counts
        layout = self._layout(*layout_counts)
        if len(data) != layout.nbytes:
            raise ValueError(f"a step of {len(data)} bytes for a layout of {layout.nbytes}")
        host = self._host_buffer(layout.nbytes)
        host[: layout.nbytes] = np.frombuffer(data, dtype=np.uint8)
        views = layout.host_views(host)
        num_prev = 0 if prev_sampled is None else len(prev_sampled)
        in_order = layout.counts[0] == layout.count("gather_dst") == num_prev
        in_order = in_order and _is_range(views["gather_dst"]) and _is_range(views["gather_src"])
        no_rows = np.zeros(0, dtype=np.int64)
        return self._upload(layout, host, prev_sampled, [], no_rows, in_order, width)

    def _upload(
        self,
        layout: _Layout,
        host: np.ndarray,
        prev_sampled: torch.Tensor | None,
        sampling: list[Request],
        sample_ends: np.ndarray,
        in_order: bool,
        width: int,
    ) -> PackedInputs:
        """Copy a filled host buffer to the device; the views, the placeholders' gather and the
        attention metadata (its host lists read back from the buffer). ``in_order``: every
        token is a placeholder for the id sampled by the same row last step, so there is no
        gather: the forward takes ``prev_sampled`` itself (PackedInputs.ids_from). ``width``:
        the widest block table, the width of the metadata's block tables (the layout's room
        past it is padding: the kernels size their work by the tables' width)."""
        views = layout.device_views(self._copy_to_device(layout.nbytes))
        input_ids = views["input_ids"]
        ids_from = None
        if layout.count("gather_dst"):
            if prev_sampled is None:
                raise RuntimeError("a placeholder token with no previous step to take it from")
            if in_order:
                ids_from = prev_sampled
            else:
                src = prev_sampled.index_select(0, views["gather_src"])
                input_ids.index_copy_(0, views["gather_dst"], src)
        if self.timeline is not None:
            self.timeline.end()
            self.timeline = None
        host_views = layout.host_views(host)
        query_start = host_views["query_start_loc"]  # [B + 1]
        seq_lens = host_views["seq_lens"]  # [B]
        num_tokens, num_seqs = layout.counts[:2]
        # As many tokens as sequences: one each (a decode step).
        max_query_len = 1 if num_tokens == num_seqs else int(np.diff(query_start).max())
        uniform = self.mark_uniform and num_tokens == num_seqs * max_query_len > num_seqs
        ordered = self.orders_rows and layout.count("row_order") > 0
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=layout.block_tables_view(views, width),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            prefill_tiles=views["prefill_tiles"] if layout.count("prefill_tiles") else None,
            uniform_query_len=max_query_len if uniform else 0,
            # Kept as the last step's when a steady step advances: rows only append blocks.
            shared_prefix=views["shared_prefix"] if host_views["shared_prefix"][0] else None,
            # Kept too when a steady step advances: every length grows by one.
            row_order=views["row_order"] if ordered else None,
        )
        group_metadata = ()
        if layout.counts[6] > 1:
            group_metadata = (meta, *self._more_group_metadata(layout, views, meta, width))
        return PackedInputs(
            input_ids=input_ids,
            positions=views["positions"],
            meta=meta,
            group_metadata=group_metadata,
            logits_indices=views["logits_indices"],
            sampling_requests=sampling,
            sample_ends=sample_ends,
            ids_from=ids_from,
        )

    @staticmethod
    def _more_group_metadata(
        layout: _Layout, views: dict[str, torch.Tensor], meta: AttentionMetadata, width: int
    ) -> list[AttentionMetadata]:
        """Groups 1..'s metadata: group 0's with their own block tables and slot mapping."""
        tables = views["group_block_tables"][:, :, :width]  # [G-1, B, width], rows strided
        slots = views["group_slot_mapping"]  # [G-1, T]
        return [
            dataclasses.replace(meta, slot_mapping=slots[g], block_tables=tables[g])
            for g in range(layout.counts[6] - 1)
        ]

    def _host_buffer(self, nbytes: int) -> np.ndarray:
        """The next ring buffer, once the copy that last read it has completed."""
        if nbytes > self._capacity:
            if self._stream is not None:
                self._stream.synchronize()  # no copy still reads them
            self._allocate(max(nbytes, 2 * self._capacity))
        self._next = (self._next + 1) % len(self._host)
        event = self._copied[self._next]
        if event is not None:
            event.synchronize()  # normally long done: it is two steps old
        return self._host[self._next]

    def _copy_to_device(self, nbytes: int) -> torch.Tensor:
        """The step's one host-to-device copy; returns the device buffer."""
        src = self._host_tensors[self._next][:nbytes]
        if self.timeline is not None:
            self.timeline.begin()  # the step's first GPU work (step stats)
        self._device_buf[:nbytes].copy_(src, non_blocking=self._pinned)
        if self._pinned:
            event = self._copied[self._next] or torch.cuda.Event()
            event.record(self._stream)
            self._copied[self._next] = event
        return self._device_buf


_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)
_TORCH = {_I64.char: torch.int64, _I32.char: torch.int32}


class _Layout:
    """Byte offsets of one step's sections, each 16-byte aligned (a uint8 view reinterpreted
    as int64 must at least start at a multiple of 8). ``counts`` rebuild it on another rank."""

    def __init__(
        self,
        num_tokens: int,
        num_seqs: int,
        num_sampling: int,
        num_gather: int,
        width: int,
        num_tiles: int = 0,
        num_groups: int = 1,
    ) -> None:
        self.counts = (
            num_tokens, num_seqs, num_sampling, num_gather, width, num_tiles, num_groups
        )  # fmt: skip
        counts = (
            ("input_ids", num_tokens, _I64),
            ("positions", num_tokens, _I64),
            ("slot_mapping", num_tokens, _I64),
            ("logits_indices", num_sampling, _I64),
            ("gather_dst", num_gather, _I64),
            ("gather_src", num_gather, _I64),
            ("query_start_loc", num_seqs + 1, _I32),
            ("seq_lens", num_seqs, _I32),
            ("block_tables", num_seqs * width, _I32),
            ("prefill_tiles", 2 * num_tiles, _I32),
            ("shared_prefix", 2, _I32),  # AttentionMetadata.shared_prefix (0 tokens: none)
            # AttentionMetadata.row_order: a decode-only step's (as many tokens as sequences).
            ("row_order", num_seqs if num_tokens == num_seqs else 0, _I32),
            # KV layer groups 1.. (none with one group): their slots and tables, group by group.
            ("group_slot_mapping", (num_groups - 1) * num_tokens, _I64),
            ("group_block_tables", (num_groups - 1) * num_seqs * width, _I32),
        )
        self.sections: dict[str, tuple[int, int, np.dtype]] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._views_of: torch.Tensor | None = None  # the buffer ``_views`` are views of
        # The last narrowed block tables: (the views they narrow, width, the view).
        self._narrowed: tuple[dict[str, torch.Tensor], int, torch.Tensor] | None = None
        # Each host ring buffer's views: id -> (the buffer, kept so the id stays its, views).
        self._host_views: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
        offset = 0
        for name, count, dtype in counts:
            self.sections[name] = (offset, count, dtype)
            # 16-byte aligned starts: Triton specialises kernels on pointer alignment, so
            # offsets that move with the batch's shape would compile extra variants.
            offset += -(-count * dtype.itemsize // 16) * 16
        self.nbytes = offset

    @property
    def width(self) -> int:
        """The block tables' width in the layout: their room (InputBatch._room), at least
        the step's widest table."""
        return self.counts[4]

    def count(self, name: str) -> int:
        return self.sections[name][1]

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Every section as a view of the host buffer ``buf``; made once per buffer."""
        entry = self._host_views.get(id(buf))
        if entry is None or entry[0] is not buf:
            entry = buf, {name: self.host_view(buf, name) for name in self.sections}
            self._host_views[id(buf)] = entry
        return entry[1]

    def host_view(self, buf: np.ndarray, name: str) -> np.ndarray:
        start, count, dtype = self.sections[name]
        return buf[start : start + count * dtype.itemsize].view(dtype)

    def device_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every section as a view of ``buf`` (the block tables as [B, room], the prefill
        tiles as [N, 2]); made on the first call for a buffer and reused after."""
        if self._views_of is not buf:
            views = {name: self.device_view(buf, name) for name in self.sections}
            views["block_tables"] = views["block_tables"].view(self.counts[1], self.width)
            views["prefill_tiles"] = views["prefill_tiles"].view(-1, 2)
            num_more = self.counts[6] - 1
            views["group_block_tables"] = views["group_block_tables"].view(
                num_more, self.counts[1], self.width
            )
            views["group_slot_mapping"] = views["group_slot_mapping"].view(num_more, self.counts[0])
            self._views, self._views_of = views, buf
        return self._views

    def block_tables_view(self, views: dict[str, torch.Tensor], width: int) -> torch.Tensor:
        """The device block tables [B, width] of ``device_views``' [B, room]: the first
        ``width`` columns, rows strided by the room; made once per width while the views last
        (a steady decode asks for the same width block_size steps in a row)."""
        if width == self.width:
            return views["block_tables"]
        cached = self._narrowed
        if cached is None or cached[0] is not views or cached[1] != width:
            cached = self._narrowed = views, width, views["block_tables"][:, :width]
        return cached[2]

    def device_view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        start, count, dtype = self.sections[name]
        return buf[start : start + count * dtype.itemsize].view(_TORCH[dtype.char])


def _packed_bytes(
    tokens: int, seqs: int, sampling: int, gather: int, width: int, tiles: int, groups: int
) -> int:
    return _Layout(tokens, seqs, sampling, gather, width, tiles, groups).nbytes


def _fill_tables(
    block_tables: np.ndarray,  # [B, room] int32
    flat_tables: array.array,
    width_list: list[int],
    width: int,
) -> None:
    """Lay the step's flattened tables (row i ``width_list[i]`` ids) into ``block_tables``,
    padded with 0 past each row's end."""
    flat = np.frombuffer(flat_tables, dtype=np.int32)
    num_seqs = len(width_list)
    if len(flat) == num_seqs * width:  # every table is as wide as the widest
        block_tables[:, :width] = flat.reshape(num_seqs, width)
        block_tables[:, width:] = 0
        return
    widths = np.array(width_list, dtype=np.int64)  # [B]
    block_tables.fill(0)
    rows = np.repeat(np.arange(num_seqs), widths)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(widths) - widths, widths)
    block_tables[rows, cols] = flat


def _is_range(values: np.ndarray) -> bool:
    """Whether ``values`` are 0, 1, ..., len - 1."""
    return bool(np.array_equal(values, np.arange(len(values))))


def _prev_rows_of(
    prev_sampling: Sequence[Request], requests: list[Request], seqs: np.ndarray
) -> np.ndarray | list[int]:
    """The row in the previous step's sampled ids of each request in ``seqs`` (sequence indices
    of this step): in a steady decode every row waits on the row it had last step, which the
    list comparison (by identity, in C) finds without a lookup per request."""
    if len(seqs) == len(requests) and requests == prev_sampling:
        return seqs  # 0..B-1: each request's row is its own
    rows = {id(r): i for i, r in enumerate(prev_sampling)}
    try:
        return [rows[id(requests[i])] for i in seqs.tolist()]
    except KeyError:
        missing = next(r.request_id for r in requests if id(r) not in rows)
        raise RuntimeError(
            f"request {missing!r} waits on a token that the previous step did not sample"
        ) from None
