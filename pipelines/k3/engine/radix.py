"""Radix prefix cache over token ids: shared MLA pages plus KDA state checkpoints.

A node covers the tokens `[start, end)` of every sequence that passes through it and holds

- `pages`: the MLA pages with page indices `start // page_size .. ceil(end / page_size) - 1` of the sequence that
  created it. Rows below `start` in its first page are copies of the parent's (a request that forks in the middle
  of a page copies that page first), so every page holds valid rows for every position of the node's path up to
  the node's `end`. A page split between parent and child is shared by both (reference counted by the pool).
- `checkpoints`: `{position: slot}`, the KDA state after the first `position` tokens, for `start < position <= end`.
  KDA state is a running summary, not per token, so a hit can only resume where a checkpoint was taken: at a
  prefill chunk boundary, a fork point, the end of a prompt, or a finished request's last token.

Lookup returns the deepest usable resume point `c <= matched`; the caller shares the pages below `c`, copies the
partial page and the checkpoint, and replays tokens from `c`. Leaves are evicted least recently used first.
"""

import itertools
from dataclasses import dataclass, field

from h3gen.pipelines.k3.engine.pool import MemoryPool


@dataclass(eq=False)
class Node:
    start: int
    tokens: list[int]
    pages: list[int]
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    checkpoints: dict[int, int] = field(default_factory=dict)
    last_used: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class PrefixHit:
    resume: int  # tokens whose state the request takes from the cache
    matched: int  # tokens found in the tree (>= resume); a fork point when the prompt goes on past it
    pages: list[int]  # pages covering [0, resume), shared (the last one may be partial: copy it)
    slot: int | None  # checkpoint to copy, None when resume == 0 or the model has no KDA layers


class RadixCache:
    def __init__(self, pool: MemoryPool):
        self.pool = pool
        self.root = Node(0, [], [])
        self._clock = itertools.count(1)

    # ----------------------------------------------------------------- lookup
    def _walk(self, tokens: list[int]):
        """[(node, tokens matched in it)] along the longest matching path (root excluded)."""
        path, node, pos = [], self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = 0
            while n < len(child.tokens) and pos + n < len(tokens) and child.tokens[n] == tokens[pos + n]:
                n += 1
            path.append((child, n))
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return path

    def match(self, tokens: list[int], limit: int) -> PrefixHit:
        """The longest cached prefix of `tokens`, and the deepest resume point `<= limit` it offers."""
        path = self._walk(tokens)
        now = next(self._clock)
        for node, _ in path:
            node.last_used = now
        matched = sum(n for _, n in path)
        top = min(matched, limit)
        resume, slot = 0, None
        if self.pool.uses_slots:
            for node, n in path:
                for position, s in node.checkpoints.items():
                    if position <= min(node.start + n, top) and position > resume:
                        resume, slot = position, s
        else:
            resume = top
        return PrefixHit(resume, matched, self._pages(path, resume), slot)

    def _pages(self, path, length: int) -> list[int]:
        if not self.pool.uses_pages or length == 0:
            return []
        size = self.pool.page_size
        out = []
        for index in range(-(-length // size)):
            last = min((index + 1) * size, length) - 1  # the page's last position we need
            node = next(node for node, _ in path if node.start <= last < node.end)
            out.append(node.pages[index - node.start // size])
        return out

    # ----------------------------------------------------------------- insert
    def insert(self, tokens: list[int], pages: list[int], checkpoints: dict[int, int]) -> None:
        """Add a sequence whose MLA rows are in `pages` (the owner keeps its own references; the tree takes new
        ones) and whose KDA states at some positions are in `checkpoints` (the tree takes these slots, freeing
        those it already has)."""
        size = self.pool.page_size
        node, pos = self.root, 0
        now = next(self._clock)
        checkpoints = dict(checkpoints)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new_pages = pages[pos // size : -(-len(tokens) // size)] if self.pool.uses_pages else []
                for page in new_pages:
                    self.pool.incref(page)
                child = Node(pos, list(tokens[pos:]), new_pages, parent=node, last_used=now)
                node.children[tokens[pos]] = child
                node, pos = child, len(tokens)
                break
            n = 0
            while n < len(child.tokens) and pos + n < len(tokens) and child.tokens[n] == tokens[pos + n]:
                n += 1
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            node, pos = child, pos + n
        # Attach checkpoints to the nodes that cover them.
        for position, slot in checkpoints.items():
            owner = self._owner(tokens, position)
            if owner is None or position in owner.checkpoints:
                self.pool.free_slot(slot)
            else:
                owner.checkpoints[position] = slot

    def _owner(self, tokens: list[int], position: int) -> Node | None:
        """The node on `tokens`' path with `start < position <= end` (the path exists: it was just inserted)."""
        for node, n in self._walk(tokens):
            if node.start < position <= node.start + n:
                return node
        return None

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node` after its first `n` tokens; returns the new upper part (the old object stays the child)."""
        size = self.pool.page_size
        cut = node.start + n
        if self.pool.uses_pages:
            first = node.start // size
            upper_pages = node.pages[: -(-cut // size) - first]
            lower_pages = node.pages[cut // size - first :]
            if cut % size:  # the page holding the cut is now listed by both
                self.pool.incref(node.pages[cut // size - first])
        else:
            upper_pages, lower_pages = [], []
        upper = Node(node.start, node.tokens[:n], upper_pages, parent=node.parent, last_used=node.last_used)
        upper.checkpoints = {p: s for p, s in node.checkpoints.items() if p <= cut}
        node.checkpoints = {p: s for p, s in node.checkpoints.items() if p > cut}
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.start, node.pages, node.parent = node.tokens[n:], cut, lower_pages, upper
        upper.children[node.tokens[0]] = node
        return upper

    # ----------------------------------------------------------------- eviction
    def evict_one(self) -> bool:
        """Drop the least recently used leaf (its page references and checkpoints). False when empty."""
        leaves = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        if not leaves:
            return False
        victim = min(leaves, key=lambda node: node.last_used)
        for page in victim.pages:
            self.pool.decref(page)
        for slot in victim.checkpoints.values():
            self.pool.free_slot(slot)
        del victim.parent.children[victim.tokens[0]]
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass

    def size(self) -> dict:
        nodes = checkpoints = tokens = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes += 1
            tokens += len(node.tokens)
            checkpoints += len(node.checkpoints)
            stack.extend(node.children.values())
        return dict(nodes=nodes, tokens=tokens, checkpoints=checkpoints)
