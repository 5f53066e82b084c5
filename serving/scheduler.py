"""The engine's scheduler and its KV memory: which sequences run each step, and which blocks hold their keys/values.

Scheduler.schedule() is the middle of every Engine.step:
  1. admit waiting sequences, oldest first, while the running set has room and free KV blocks stay above a
     watermark (admission control sits next to the KV accounting);
  2. plan the step's work under a token budget: one decode token for every running sequence, then prefill chunks
     for the sequences still reading their prompts (chunked prefill: a long prompt takes several steps instead of
     freezing everyone's decode for one long one);
  3. give each planned sequence the blocks its new positions need; when none are left, preempt the newest running
     sequence (its blocks are freed and it is recomputed from its tokens later) rather than fail.

BlockManager owns the blocks (kvcache.BlockPool): the free list, a reference count per block and the prefix cache.
A full block is keyed by a chained hash of its tokens and everything before them; a later sequence whose tokens
start the same way reuses those blocks (the token ids are compared too, so a hash collision cannot return wrong
keys/values). Unreferenced cached blocks stay until memory is needed, then go least recently used first. Two
sequences share blocks in two ways: a prefix-cache hit (full blocks only, never written again) and a fork
(parallel sampling: n / best_of choices of one prompt share all of its blocks). A fork's first write goes into the
prompt's last block when that one is partial: that block is copied first, for each fork but the last holder
(copy-on-write, as in PagedAttention), so no shared block is ever written.
"""
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvcache import BlockPool
from features.sinks import slot_of


@dataclass
class EngineConfig:
    block_size: int = 16  # positions per KV block
    num_blocks: int = 512  # blocks in the pool, block 0 (padding) included
    max_running: int = 32  # sequences decoded together at most
    max_waiting: int = 256  # submit() raises QueueFull beyond this many queued sequences
    token_budget: int = 256  # tokens computed per step: the decodes plus prefill chunks
    # While sequences decode, at most this many prompt tokens a step (chunked prefill): a step's time, and so the
    # running streams' time between tokens, grows by one chunk's forward at most. None: the token budget's rest.
    prefill_chunk: int | None = None
    watermark: float = 0.01  # admit only while this share of the blocks would stay free
    prefix_caching: bool = True
    static_batching: bool = False  # admit only into an empty running set: the old way, for comparison
    cache_window: int | None = None  # a rolling cache of this many slots per sequence (sinks.py); None: all of it
    sink_tokens: int = 4  # with cache_window: the opening positions it keeps
    # Pad each decode batch to a power-of-two row count (at most max_running) and block-table width, so that a
    # compiled step sees few shapes: with CUDA graphs, one graph is captured per bucket and replayed. None: when
    # the step runs CUDA graphs (compiled "full" on a GPU).
    bucket_batches: bool | None = None
    # Forwards of at least this many rows (a decode batch's rows, a prefill chunk's tokens) run the model's
    # quantized and bf16 layers as float32 matrices dequantized once (ops/wide.py): on CPU the faster product for
    # many rows, at the memory of that copy, and rounded otherwise than one row alone. None: off.
    wide_rows: int | None = None

    def max_len(self, context: int) -> int:
        """The positions a sequence may fill: the model's context; unbounded through a rolling cache."""
        return context if self.cache_window is None else sys.maxsize


@dataclass(eq=False)
class Seq:
    """A sequence to compute: its tokens (prompt, then generated) and how many of them have keys/values in its
    blocks (n_computed)."""
    tokens: list[int]
    n_prompt: int
    width: int = 1  # running slots it takes when admitted: a prompt that will fork into best_of takes best_of
    reuse: bool = True  # may take blocks from the prefix cache (not while its prompt's logprobs are computed)
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block, in order
    n_computed: int = 0
    cached: int = 0  # prompt positions reused from the prefix cache when first admitted


def chain_hash(previous: int, tokens: tuple[int, ...]) -> int:
    """A block's key: its tokens and, through `previous`, every token before them."""
    return hash((previous, tokens))


class BlockManager:
    """Free blocks, reference counts and the prefix cache (hash -> block, with the block's tokens to verify)."""

    def __init__(self, pool: BlockPool, prefix_caching: bool, window: int | None = None, sinks: int = 0):
        self.pool, self.block_size, self.prefix_caching = pool, pool.block_size, prefix_caching
        self.window, self.sinks = window, sinks  # a rolling cache (EngineConfig.cache_window): its blocks are a ring
        self.free: deque[int] = deque(range(1, pool.num_blocks))  # block 0 pads block tables
        self.refs = [0] * pool.num_blocks
        self.by_hash: dict[int, int] = {}  # chained hash -> block
        self.contents: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (its hash, its tokens)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest use first

    def slots(self, n_positions: int) -> int:
        """The slots n positions of a sequence take: n, or at most the window of a rolling cache."""
        return n_positions if self.window is None else min(n_positions, self.window)

    def chunk_limit(self, start: int) -> int:
        """The most positions one forward from `start` may compute: a rolling cache's forward ends before its
        window, or is one token (sinks.SinkKVCache.spans)."""
        return sys.maxsize if self.window is None else max(1, self.window - start)

    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def in_use(self) -> int:
        return sum(1 for r in self.refs[1:] if r > 0)

    # ---- per sequence ----

    def reuse_prefix(self, seq: Seq) -> None:
        """Take the cached blocks matching the start of seq.tokens; at least one token is left to compute (its
        logits start the decoding)."""
        while self.prefix_caching and seq.reuse and (len(seq.blocks) + 1) * self.block_size < len(seq.tokens):
            h, tokens = self._next_hash(seq)
            block = self._lookup(h, tokens)
            if block is None:
                break
            seq.blocks.append(block)
            seq.hashes.append(h)
            seq.n_computed += self.block_size

    def computed(self, seq: Seq, n: int) -> None:
        """n more positions of seq hold keys/values: offer every block that just filled up to the prefix cache."""
        seq.n_computed += n
        while self.window is None and len(seq.hashes) < seq.n_computed // self.block_size:  # a ring is rewritten
            h, tokens = self._next_hash(seq)
            seq.hashes.append(h)
            self._register(seq.blocks[len(seq.hashes) - 1], h, tokens)

    def grow(self, seq: Seq, n_positions: int) -> bool:
        """Give seq blocks of its own for positions seq.n_computed..n_positions-1; False if the pool ran out."""
        slot = seq.n_computed if self.window is None else slot_of(seq.n_computed, self.sinks, self.window)
        i = slot // self.block_size  # the block the next position is written into, if seq has it
        if i < len(seq.blocks) and self.refs[seq.blocks[i]] > 1:  # shared with a fork: copy on write
            block = self._allocate()
            if block is None:
                return False
            self.pool.copy_block(seq.blocks[i], block)
            self._release(seq.blocks[i])
            seq.blocks[i] = block
        while len(seq.blocks) * self.block_size < self.slots(n_positions):
            block = self._allocate()
            if block is None:
                return False
            seq.blocks.append(block)
        return True

    def fork(self, parent: Seq, child: Seq) -> None:
        """child holds what parent holds: the same blocks (one more reference each), hashes and computed positions."""
        for block in parent.blocks:
            self.refs[block] += 1
        child.blocks, child.hashes = list(parent.blocks), list(parent.hashes)
        child.n_computed, child.cached = parent.n_computed, parent.cached

    def drop(self, seq: Seq) -> None:
        """Give back seq's blocks; it holds nothing computed afterwards."""
        for block in seq.blocks:
            self._release(block)
        seq.blocks, seq.hashes, seq.n_computed = [], [], 0

    # ---- per block ----

    def _next_hash(self, seq: Seq) -> tuple[int, tuple[int, ...]]:
        """The chained hash of seq's next full block (the one after seq.hashes) and that block's tokens."""
        i, bs = len(seq.hashes), self.block_size
        tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
        return chain_hash(seq.hashes[-1] if seq.hashes else 0, tokens), tokens

    def _allocate(self) -> int | None:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # least recently used
            h, _ = self.contents.pop(block)
            del self.by_hash[h]
        else:
            return None
        self.refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.contents:
                self.evictable[block] = None  # kept for a later prefix hit until memory is needed
            else:
                self.free.append(block)

    def _lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block for chained hash h, if its tokens are these; takes a reference."""
        block = self.by_hash.get(h)
        if block is None or self.contents[block][1] != tokens:
            return None
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1
        return block

    def _register(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        """Offer a just-filled block to the prefix cache (a block with the same hash already there wins)."""
        if self.prefix_caching and h not in self.by_hash:
            self.by_hash[h] = block
            self.contents[block] = (h, tokens)


class Scheduler:
    """The waiting queue and the running set; schedule() decides each step's work and gives it blocks."""

    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # admission order: the last one is preempted first
        self.preemptions = 0

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def start(self, seq: Seq) -> None:
        """Run seq from the next step on without admission: a fork, which holds its parent's blocks."""
        self.running.append(seq)

    def admit_computed(self, seq: Seq) -> bool:
        """Run seq from the next step if the running set has room (False: not yet): its blocks already hold its first
        seq.n_computed positions' keys/values, computed elsewhere (a prefill worker: serving/disagg.py)."""
        if sum(s.width for s in self.running) + seq.width > self.config.max_running:
            return False
        self.running.append(seq)
        return True

    def remove(self, seq: Seq) -> None:
        """seq is done (finished, aborted or failed): out of the queues, its blocks given back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.drop(seq)

    def schedule(self) -> tuple[list[Seq], list[tuple[Seq, int]]]:
        """This step's work, blocks given: the sequences that decode one token, and (sequence, n) prefill chunks."""
        self._admit()
        return self._plan()

    def _admit(self) -> None:
        cfg = self.config
        if cfg.static_batching and self.running:
            return
        reserve = max(1, int(cfg.watermark * cfg.num_blocks))
        slots = sum(s.width for s in self.running)  # a prompt still to fork keeps room for its forks
        while self.waiting and slots + self.waiting[0].width <= cfg.max_running:
            seq = self.waiting[0]
            self.blocks.reuse_prefix(seq)
            needed = -(-self.blocks.slots(len(seq.tokens)) // cfg.block_size) - len(seq.blocks)  # what it computes
            if self.running and self.blocks.available() - needed < reserve:
                self.blocks.drop(seq)  # not admitted now: give back the prefix blocks it took
                break
            if len(seq.tokens) == seq.n_prompt:  # first admission (not a preempted sequence's return)
                seq.cached = seq.n_computed
            self.running.append(self.waiting.popleft())
            slots += seq.width

    def _plan(self) -> tuple[list[Seq], list[tuple[Seq, int]]]:
        """Every sequence in decode gets its token, then prefill chunks fill the budget. Blocks are allocated here;
        a sequence that cannot get one preempts the newest running sequence."""
        decodes = [s for s in self.running if len(s.tokens) - s.n_computed == 1]
        chunks = []
        budget = self.config.token_budget - len(decodes)
        if decodes and self.config.prefill_chunk is not None:  # streams are running: keep their steps short
            budget = min(budget, self.config.prefill_chunk)
        for seq in self.running:
            need = len(seq.tokens) - seq.n_computed
            if need > 1 and budget > 0:
                chunks.append((seq, min(need, budget, self.blocks.chunk_limit(seq.n_computed))))
                budget -= chunks[-1][1]
        for seq, n in [(s, 1) for s in decodes] + chunks:
            while seq in self.running and not self.blocks.grow(seq, seq.n_computed + n):
                self._preempt(self.running[-1])
        decodes = [s for s in decodes if s in self.running]
        chunks = [(s, n) for s, n in chunks if s in self.running]
        return decodes, chunks

    def _preempt(self, seq: Seq) -> None:
        """Free seq's blocks and queue it first: it is recomputed from its tokens (prompt and generated) later."""
        self.running.remove(seq)
        self.blocks.drop(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1
