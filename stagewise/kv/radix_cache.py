"""The radix prefix cache (SGLang's RadixAttention): a tree of token runs over the KV blocks.

Every sequence the engine computed is a path from the root: each node holds a run of token ids
(the edge's label) and the KV blocks behind those positions. A lookup walks down the tree
comparing tokens — no hashing — and stops at the first token that differs, so a match has
token granularity: it may end inside a block. The request then shares every block of the
match; the last one, partly used, is copied before the request writes its own tokens into it
(copy-on-write, kv/block_manager.py). Where the hashed cache reuses only whole blocks, a radix
match also reuses the part of a block before the first difference: on average about
(block_size - 1) / 2 tokens more per lookup when prompts extend earlier sequences (multi-turn
chat), the gap that SGLang measured.

    root ── [You are a helpful assistant. User: hi] ──┬── [Bot: hello!]
                                                      └── [Bot: hey, what's up?]

Positions and blocks. A node's run sits at positions start .. end-1 of every sequence through
it; `blocks` are the blocks of logical indices start // bs .. (end - 1) // bs. When a run starts
or ends inside a block, that block is either shared with the neighbour (the parent, or a child
that continues in it) or is the node's own copy; in both cases it holds valid K/V for every
position of that block up to `end` along this path, so a match takes, for each block index, the
block of the deepest node it passed.

Memory. The tree keeps one reference on each block it lists (`pool.hold`): a finished request's
blocks stay in the tree, its generated tokens findable, until evicted. Nodes on the paths of
running requests are locked (reference-counted by `lock`); eviction takes unlocked leaves, least
recently used first, and a parent whose last child went becomes a leaf in turn. Blocks go back
to the free queue when no node and no request holds them.

Insertion: while a request runs, the whole blocks of each scheduled step are inserted as the
step is scheduled (others may match them in the same step; K/V are written before attention
reads them), and its locked path moves down to them; when it leaves (finished or preempted),
everything it computed goes in, the partly filled last block too. A step whose forward pass did
not complete removes the nodes it inserted (`forget_step`).
"""

import heapq
import itertools

from stagewise.kv.prefix_cache import PrefixCache, PrefixHit


class RadixNode:
    """A run of tokens, the KV blocks behind it, and where it sits in the tree."""

    __slots__ = (
        "tokens",
        "start",
        "blocks",
        "children",
        "parent",
        "lock",
        "last_use",
        "step",
        "serial",
    )

    def __init__(self, tokens: tuple, start: int, blocks: list, parent, step: int, serial: int):
        self.tokens = tokens  # the run's token ids: the label of the edge into this node
        self.start = start  # position of tokens[0] in every sequence through here
        self.blocks = blocks  # blocks of logical indices start // bs .. (end - 1) // bs
        self.children: dict[int, RadixNode] = {}  # first token of a child's run -> child
        self.parent = parent  # None for the root
        self.lock = 0  # running requests whose held path passes through (or ends at) this node
        self.last_use = 0  # the cache's clock at its latest insert or lock (LRU eviction)
        self.step = step  # the scheduling step that inserted it (forget_step removes them)
        self.serial = serial  # creation order: breaks ties between leaves used at the same time

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def common_length(run: tuple, token_ids, pos: int, limit: int) -> int:
    """How many tokens of `run` equal token_ids[pos:limit], counted from the first."""
    n = min(len(run), limit - pos)
    if run[:n] == tuple(token_ids[pos : pos + n]):
        return n
    k = 0
    while run[k] == token_ids[pos + k]:
        k += 1
    return k


class RadixCache(PrefixCache):
    kind = "radix"

    def __init__(self, pool):
        super().__init__(pool)
        self.bs = pool.block_size
        self._serials = itertools.count()
        self.root = RadixNode((), 0, [], None, step=-1, serial=next(self._serials))
        self.locked: dict[str, RadixNode] = {}  # request id -> the node its held path ends at
        self.rows: dict[str, tuple] = {}  # request id -> its blocks along that path
        self.listed: dict[int, int] = {}  # block id -> nodes listing it (one reference each)
        self.clock = 0  # ticks at each insert and lock: the LRU order
        self.step = 0  # scheduling steps begun

    def _hold(self, block_id: int) -> None:
        self.pool.hold(block_id)
        self.listed[block_id] = self.listed.get(block_id, 0) + 1

    def _release(self, block_id: int) -> bool:
        """The tree's reference on a block goes; -> True when it was the block's last holder."""
        self.listed[block_id] -= 1
        if not self.listed[block_id]:
            del self.listed[block_id]
        return self.pool.release(block_id)

    def held_by_a_request(self, block_id: int) -> bool:
        return self.pool.blocks[block_id].ref_count > self.listed.get(block_id, 0)

    # ---- lookups ----

    def match(self, token_ids: list[int]) -> PrefixHit:
        """Walk down comparing tokens; -> the blocks of the longest match (never the last token)."""
        bs, limit = self.bs, len(token_ids) - 1
        node, pos, by_index, last = self.root, 0, {}, self.root
        while pos < limit:
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            k = common_length(child.tokens, token_ids, pos, limit)
            first = child.start // bs
            for j in range(pos // bs, (pos + k - 1) // bs + 1):  # the deepest node's block wins
                by_index[j] = child.blocks[j - first]
            pos, last = pos + k, child
            if k < len(child.tokens):
                break  # the match ends inside this run
            node = child
        if pos % bs and last.step == self.step:
            # Its last block is written in the step being scheduled, after the copy that a partly
            # used block needs would be made (kv/paged.py): reuse whole blocks only.
            pos -= pos % bs
        blocks = tuple(by_index[j] for j in range(-(-pos // bs)))
        return PrefixHit(blocks, pos, "radix", tuple(token_ids[:pos]))

    def admit(self, request_id: str, hit: PrefixHit) -> None:
        """Lock the path of the hit's whole blocks (those the request holds) against eviction."""
        self._lock(request_id, hit.token_ids, hit.num_tokens // self.bs * self.bs, hit.blocks)

    # ---- insertion ----

    def insert(self, request_id, token_ids, num_tokens, blocks, final) -> None:
        """Put the request's first `num_tokens` tokens (their K/V in `blocks`) into the tree.

        While it runs (`final` False) only whole blocks go in, and its lock moves to them.
        """
        if not final:
            num_tokens = num_tokens // self.bs * self.bs
            held = self.locked.get(request_id)
            if held is not None and held.end == num_tokens:
                return  # no whole block more since its last step
        self.clock += 1
        node, pos = self.root, 0
        while pos < num_tokens:
            node.last_use = self.clock
            child = node.children.get(token_ids[pos])
            if child is None:
                node = self._add(request_id, node, token_ids, pos, num_tokens, blocks)
                break
            k = common_length(child.tokens, token_ids, pos, num_tokens)
            if k < len(child.tokens) and pos + k < num_tokens:  # the runs part inside the child
                child = self._split(child, k)
            node, pos = child, pos + k
        node.last_use = self.clock
        if not final and num_tokens:
            self._lock(request_id, token_ids, num_tokens, blocks)

    def _add(self, request_id, node: RadixNode, token_ids, pos: int, end: int, blocks) -> RadixNode:
        """Tokens pos .. end-1 go below `node` (which ends at pos): a new leaf, or `node` grows
        when it is a leaf ending on a block boundary that no other request has locked."""
        bs = self.bs
        run, new_blocks = tuple(token_ids[pos:end]), list(blocks[pos // bs : -(-end // bs)])
        for b in new_blocks:
            self._hold(b)
        own_lock = 1 if self.locked.get(request_id) is node else 0
        if node is not self.root and not node.children and pos % bs == 0 and node.lock == own_lock:
            node.tokens, node.blocks = node.tokens + run, node.blocks + new_blocks
            node.step, node.last_use = self.step, self.clock  # a failed step removes it whole
            return node
        leaf = RadixNode(run, pos, new_blocks, node, self.step, next(self._serials))
        leaf.last_use = self.clock
        node.children[run[0]] = leaf
        self._share_boundary(node)
        return leaf

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after its first k tokens; -> the new node holding them, `node`'s parent now.

        A cut inside a block leaves that block in both halves' lists: one more reference.
        """
        bs, cut, first = self.bs, node.start + k, node.start // self.bs
        top = RadixNode(node.tokens[:k], node.start, node.blocks[: (cut - 1) // bs - first + 1],
                        node.parent, node.step, next(self._serials))  # fmt: skip
        top.lock, top.last_use = node.lock, node.last_use  # every path through node passes top
        node.blocks = node.blocks[cut // bs - first :]
        if cut % bs:
            self._hold(node.blocks[0])
        node.parent.children[top.tokens[0]] = top
        node.tokens, node.start, node.parent = node.tokens[k:], cut, top
        top.children[node.tokens[0]] = node
        return top

    def _share_boundary(self, node: RadixNode) -> int:
        """When `node` ends inside a block that none of its children continues in (each has its
        own copy, which also holds `node`'s part of the block), list a child's copy instead:
        the node's own block is then held by nobody on these paths, and goes. -> blocks freed.

        Without this, a running request whose path passes `node` would keep that block locked
        without holding it, and a full pool could not give it back."""
        freed = 0
        while node is not self.root and node.children and node.end % self.bs:
            firsts = [child.blocks[0] for child in node.children.values()]
            if node.blocks[-1] in firsts:
                break
            old, node.blocks[-1] = node.blocks[-1], firsts[0]
            self._hold(firsts[0])
            freed += self._release(old)
            node.step = self.step  # the child's block may be written in the step being scheduled
            if len(node.blocks) > 1:
                break  # its first block is unchanged: nothing changes above it
            node = node.parent  # its only block changed: its parent may end inside it
        return freed

    # ---- locks ----

    def _node_ending_at(self, token_ids, position: int) -> RadixNode | None:
        """The node whose run ends at `position` along `token_ids` (split there if need be)."""
        node, pos = self.root, 0
        while pos < position:
            child = node.children.get(token_ids[pos])
            if child is None:
                return None
            k = common_length(child.tokens, token_ids, pos, position)
            if k < len(child.tokens):
                if pos + k < position:
                    return None
                child = self._split(child, k)
            node, pos = child, pos + k
        return node

    def _lock(self, request_id: str, token_ids, position: int, row=()) -> None:
        """The request's held path now ends at `position` (0: it holds no path).

        `row`: the request's blocks. Wherever a node of the path lists another block for the same
        positions (the prefix was computed twice: by this request, and before), the node takes
        the request's block and lets its own go — a locked path keeps no block that its request
        does not hold, so a request alone always fits the pool.
        """
        target = self._node_ending_at(token_ids, position) if position else None
        old = self.locked.pop(request_id, None)
        self.rows.pop(request_id, None)
        if target is not None and target is not self.root:
            self.locked[request_id], self.rows[request_id] = target, tuple(row)
            self.clock += 1
            node = target
            while node is not self.root:
                node.lock += 1
                node.last_use = self.clock
                self._adopt(node, row)
                node = node.parent
        while old is not None and old is not self.root:
            old.lock -= 1
            old = old.parent

    def _adopt(self, node: RadixNode, row) -> None:
        """Where `node` lists a block that no request holds, list the request's own (in `row`,
        valid for every position of `node`) instead.

        They may be written in the step being scheduled: the node counts as inserted by it."""
        first = node.start // self.bs
        for i, b in enumerate(node.blocks):
            if row[first + i] != b and not self.held_by_a_request(b):
                self._hold(row[first + i])
                node.blocks[i] = row[first + i]
                self._release(b)
                node.step = self.step

    def release(self, request_id: str) -> None:
        """The request left (its blocks dropped): its path is unlocked (the blocks stay in the
        tree), and the paths others hold take their own blocks where it held the tree's."""
        if request_id not in self.locked:
            return
        self._lock(request_id, (), 0)
        for rid, node in self.locked.items():
            row = self.rows[rid]
            while node is not self.root:
                self._adopt(node, row)
                node = node.parent

    # ---- eviction ----

    def nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children."""
        out, todo = [], list(self.root.children.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    def evict(self, num_blocks: int) -> int:
        """Remove unlocked leaves, least recently used first, until `num_blocks` blocks are free
        again (or nothing is left to remove); -> blocks freed."""
        freed = 0
        for freed_now, _ in self._leaves_in_eviction_order():
            freed += freed_now
            if freed >= num_blocks:
                break
        return freed

    def evict_nodes(self, count: int) -> list[tuple[int, ...]]:
        """Remove `count` nodes as `evict` would (fewer if fewer are unlocked); -> their runs."""
        if count < 1:
            return []
        removed = []
        for _, run in self._leaves_in_eviction_order():
            removed.append(run)
            if len(removed) == count:
                break
        return removed

    def _leaves_in_eviction_order(self):
        """Remove unlocked leaves one by one, least recently used first (ties: the older node); a
        parent whose last child went, unlocked, is a leaf now. Yields (blocks freed, its run)."""
        heap = [(n.last_use, n.serial, n) for n in self.nodes() if not n.children and not n.lock]
        heapq.heapify(heap)
        while heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed = self._remove(leaf) + self._share_boundary(parent)
            if parent is not self.root and not parent.children and not parent.lock:
                heapq.heappush(heap, (parent.last_use, parent.serial, parent))
            yield freed, leaf.tokens

    def _remove(self, node: RadixNode) -> int:
        """Take `node` and everything below it out of the tree; -> blocks freed."""
        del node.parent.children[node.tokens[0]]
        freed, todo = 0, [node]
        while todo:
            n = todo.pop()
            todo.extend(n.children.values())
            freed += sum(self._release(b) for b in n.blocks)
        return freed

    def begin_step(self) -> None:
        self.step += 1

    def forget_step(self) -> None:
        """The step's forward pass did not complete: remove the nodes inserted while it was
        scheduled (their K/V may never have been written), with everything below them.

        Every running request is sent back to waiting after this: their locks go first, with no
        node taking their blocks (the step may not have written them)."""
        for request_id in list(self.locked):
            self._lock(request_id, (), 0)
        todo = list(self.root.children.values())
        while todo:
            node = todo.pop()
            if node.step == self.step:
                self._remove(node)
            else:
                todo.extend(node.children.values())

    # ---- what the view, the notebooks and the tests read ----

    def describe(self) -> list[dict]:
        """The tree as plain values, parents first: id, parent id (None: a child of the root), the
        run's token ids, its first position, its blocks and its lock count."""
        ids = {id(n): i for i, n in enumerate(self.nodes())}
        return [
            {
                "id": ids[id(n)],
                "parent": ids.get(id(n.parent)),
                "tokens": list(n.tokens),
                "start": n.start,
                "blocks": list(n.blocks),
                "lock": n.lock,
            }
            for n in self.nodes()
        ]

    def cached_blocks(self, limit: int | None = None) -> list[int] | None:
        listed: dict[int, int] = {}
        for node in self.nodes():
            for b in node.blocks:
                listed[b] = listed.get(b, 0) + 1
        blocks = self.pool.blocks
        only_cached = sorted(b for b, n in listed.items() if blocks[b].ref_count == n)
        return None if limit is not None and len(only_cached) > limit else only_cached
