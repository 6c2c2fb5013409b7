"""Byte-level matcher of a compiled schema (schema.Grammar): which bytes may come next, and the state
after them.

Why bytes: tokens are byte strings (byte-level BPE splits UTF-8 characters across tokens), so the
matcher must accept a character's bytes one token at a time.

A state is a frozenset of stacks: several while `anyOf` alternatives or `enum` values still agree on the
text so far. A stack is a tuple of frames, the innermost last, ending in the frame being matched; each
frame is a small tuple, so states are hashable and the vocabulary index (vocab.py) caches the allowed
tokens per state. Frames:

    ("end",)                          the root value is complete; nothing may follow
    ("pre", node, ws)                 a value of `node` comes next, after `ws` whitespace bytes so far
    ("obj", node, i, phase, ws)       inside an object; `i` = index of the next declared property
    ("key", node, candidates, pos)    inside a declared property key: candidate indexes, bytes matched
    ("arr", node, count, phase, ws)   inside an array; `count` items so far (clamped where it stops mattering)
    ("str", pending, escape)          inside a string: UTF-8 state and escape progress (scalars.py)
    ("lstr", node, pending, escape, n) inside a string of bounded length, `n` characters started so far
    ("int", node, negative, digits)   inside an integer with bounds, its digits so far
    ("num", integer_only, phase)      inside a number
    ("lit", node, candidates, pos)    inside an enum / const / true / false / null literal

Whitespace runs between tokens are capped (MAX_WS) so that a model cannot loop on blank lines.
"""

from __future__ import annotations

from loraplex.engine.guided.scalars import CLOSE, QUOTE, integer_in_range, integer_reachable, string_step
from loraplex.engine.guided.schema import Grammar

State = frozenset  # of stacks: tuple[tuple, ...]

END = ("end",)
STR = ("str", 0, 0)
MAX_WS = 32
WS = frozenset(b" \t\n\r")

# object phases; "key" and "value" wait for the frame above them to complete
OPEN, NEED_KEY, KEY, COLON, VALUE, AFTER = range(6)
# array phases reuse OPEN, VALUE and AFTER
# number phases
MINUS, ZERO, INT, DOT, FRAC, EXP_MARK, EXP_SIGN, EXP = range(8)
NUMBER_COMPLETE = frozenset({ZERO, INT, FRAC, EXP})
MEMO_LIMIT = 50_000  # transitions kept per schema (a few MB); the memo starts over beyond


class Matcher:
    """Transitions of one grammar, memoized per (state, byte): decoding revisits the same states."""

    def __init__(self, grammar: Grammar):
        self.nodes = grammar.nodes
        self.start: State = frozenset({(END, ("pre", grammar.root, 0))})
        self._memo: dict[tuple[State, int], State | None] = {}
        self._by_kind = {"pre": self._before_value, "obj": self._object, "key": self._key, "arr": self._array,
                         "num": self._number, "lstr": self._bounded_string, "int": self._bounded_integer,
                         "lit": self._literal_frame}  # frame kind -> its transition (rest, top, byte)

    # --- the state API ------------------------------------------------------------------------

    def advance(self, state: State, byte: int) -> State | None:
        """The state after `byte`, or None where the schema does not allow it."""
        key = (state, byte)
        if key in self._memo:
            return self._memo[key]
        out: set = set()
        for stack in state:
            out.update(self._step(stack, byte))
        result = frozenset(out) if out else None
        if len(self._memo) >= MEMO_LIMIT:
            self._memo.clear()
        self._memo[key] = result
        return result

    def advance_bytes(self, state: State | None, data: bytes) -> State | None:
        for b in data:
            if state is None:
                return None
            state = self.advance(state, b)
        return state

    def accepts(self, state: State) -> bool:
        """The text so far is one complete value (a root number may still grow)."""
        return any(s == (END,) or (len(s) == 2 and self._number_complete(s[1])) for s in state)

    def _number_complete(self, frame: tuple) -> bool:
        if frame[0] == "num":
            return frame[2] in NUMBER_COMPLETE
        if frame[0] == "int":
            _, lo, hi = self.nodes[frame[1]]
            return bool(frame[3]) and integer_in_range(lo, hi, frame[2], frame[3])
        return False

    @staticmethod
    def terminal(state: State) -> bool:
        """Complete, and no byte may follow."""
        return state == frozenset({(END,)})

    def string_rooms(self, state: State) -> frozenset[tuple[int, int | None]] | None:
        """Where every stack is inside a string with no escape under way: (UTF-8 state, characters it
        may still start, None for no limit) of each. Tokens free of quotes and backslashes then stay
        inside it, limited only by that room (vocab.py's fast path)."""
        rooms = set()
        for stack in state:
            top = stack[-1]
            if top[0] == "str" and not top[2]:
                rooms.add((top[1], None))
            elif top[0] == "lstr" and not top[3]:
                hi = self.nodes[top[1]][2]
                rooms.add((top[2], None if hi is None else hi - top[4]))
            else:
                return None
        return frozenset(rooms)

    # --- transitions ------------------------------------------------------------------------------

    def _step(self, stack: tuple, b: int) -> list[tuple]:
        top, rest = stack[-1], stack[:-1]
        if top[0] == "str":  # the most frequent frame: inside a plain string
            return self._string(stack, rest, top, b)
        handler = self._by_kind.get(top[0])
        return [] if handler is None else handler(rest, top, b)  # "end" takes nothing

    def _before_value(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        if b in WS:
            return [rest + (("pre", top[1], top[2] + 1),)] if top[2] < MAX_WS else []
        return self._dispatch(rest, top[1], b)

    def _literal_frame(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        return self._literal(rest, top[1], top[2], top[3], b)

    def _dispatch(self, rest: tuple, n: int, b: int) -> list[tuple]:
        """The first byte of a value of node `n`."""
        node = self.nodes[n]
        kind = node[0]
        if kind == "union":
            return [s for alt in node[1] for s in self._dispatch(rest, alt, b)]
        if kind == "obj":
            return [rest + (("obj", n, 0, OPEN, 0),)] if b == 0x7B else []
        if kind == "arr":
            return [rest + (("arr", n, 0, OPEN, 0),)] if b == 0x5B else []
        if kind == "str":
            return [rest + (STR,)] if b == QUOTE else []
        if kind == "num":
            phase = MINUS if b == 0x2D else ZERO if b == 0x30 else INT if 0x31 <= b <= 0x39 else None
            return [] if phase is None else [rest + (("num", node[1], phase),)]
        if kind == "lstr":
            return [rest + (("lstr", n, 0, 0, 0),)] if b == QUOTE else []
        if kind == "int":
            return self._bounded_integer(rest, ("int", n, False, ""), b)
        return self._literal(rest, n, tuple(range(len(node[1]))), 0, b)

    def _complete(self, rest: tuple) -> list[tuple]:
        """The value above `rest` is complete: its parent moves on."""
        parent, above = rest[-1], rest[:-1]
        kind = parent[0]
        if kind == "obj":
            _, n, i, phase, _ = parent
            return [above + (("obj", n, i, COLON if phase == KEY else AFTER, 0),)]
        if kind == "arr":
            _, n, count, _, _ = parent
            _, _, lo, hi = self.nodes[n]
            return [above + (("arr", n, min(count + 1, lo if hi is None else hi), AFTER, 0),)]
        return [rest]  # the root value: rest == (END,)

    def _string(self, stack: tuple, rest: tuple, top: tuple, b: int) -> list[tuple]:
        step = string_step(top[1], top[2], b)
        if step is None:
            return []
        if step is CLOSE:
            return self._complete(rest)
        pending, escape, _ = step
        return [stack] if (pending, escape) == top[1:] else [rest + (("str", pending, escape),)]

    def _bounded_string(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        _, n, pending, escape, count = top
        _, lo, hi = self.nodes[n]
        step = string_step(pending, escape, b)
        if step is None:
            return []
        if step is CLOSE:
            return self._complete(rest) if count >= lo else []
        pending, escape, starts = step
        if starts:
            if hi is not None and count >= hi:
                return []
            count = count + 1 if hi is not None else min(count + 1, lo)  # unbounded above: lo is all that counts
        return [rest + (("lstr", n, pending, escape, count),)]

    def _bounded_integer(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        _, n, negative, digits = top
        _, lo, hi = self.nodes[n]
        if b == 0x2D and not negative and not digits:
            return [rest + (("int", n, True, ""),)] if integer_reachable(lo, hi, True, "") else []
        if 0x30 <= b <= 0x39 and digits != "0":
            longer = digits + chr(b)
            if integer_reachable(lo, hi, negative, longer):
                return [rest + (("int", n, negative, longer),)]
        if digits and integer_in_range(lo, hi, negative, digits):  # it ended one byte ago: the byte is its parent's
            return [s for done in self._complete(rest) for s in self._step(done, b)]
        return []

    def _number(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        _, integer, phase = top
        digit = 0x30 <= b <= 0x39
        nxt = None
        if phase == MINUS:
            nxt = ZERO if b == 0x30 else INT if digit else None
        elif phase in (ZERO, INT):
            if phase == INT and digit:
                nxt = INT
            elif not integer and b == 0x2E:
                nxt = DOT
            elif not integer and b in (0x65, 0x45):
                nxt = EXP_MARK
        elif phase in (DOT, FRAC):
            nxt = FRAC if digit else EXP_MARK if phase == FRAC and b in (0x65, 0x45) else None
        elif phase == EXP_MARK:
            nxt = EXP if digit else EXP_SIGN if b in (0x2B, 0x2D) else None
        elif digit:  # EXP_SIGN, EXP
            nxt = EXP
        if nxt is not None:
            return [rest + (("num", integer, nxt),)]
        if phase in NUMBER_COMPLETE:  # the number ended one byte ago: this byte belongs to its parent
            return [s for done in self._complete(rest) for s in self._step(done, b)]
        return []

    def _literal(self, rest: tuple, n: int, candidates: tuple, pos: int, b: int) -> list[tuple]:
        options = self.nodes[n][1]
        keep = [i for i in candidates if options[i][pos] == b]
        out = self._complete(rest) if any(len(options[i]) == pos + 1 for i in keep) else []
        longer = tuple(i for i in keep if len(options[i]) > pos + 1)
        if longer:
            out.append(rest + (("lit", n, longer, pos + 1),))
        return out

    # --- objects and arrays -------------------------------------------------------------------

    def _next_keys(self, props: tuple, i: int) -> tuple[int, ...]:
        """Declared properties that may come next: from `i` on, up to and including the first required."""
        out = []
        for j in range(i, len(props)):
            out.append(j)
            if props[j][2]:
                break
        return tuple(out)

    @staticmethod
    def _may_close(props: tuple, i: int) -> bool:
        return not any(p[2] for p in props[i:])

    def _object(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        _, n, i, phase, ws = top
        _, props, free = self.nodes[n]
        if b in WS:
            return [rest + (("obj", n, i, phase, ws + 1),)] if ws < MAX_WS else []
        if phase in (OPEN, NEED_KEY) and b == QUOTE:
            if props:
                keys = self._next_keys(props, i)
                return [rest + (("obj", n, i, KEY, 0), ("key", n, keys, 0))] if keys else []
            return [rest + (("obj", n, i, KEY, 0), STR)] if free is not None else []
        if phase == COLON and b == 0x3A:
            child = props[i - 1][1] if props else free
            return [rest + (("obj", n, i, VALUE, 0), ("pre", child, 0))]
        if phase == AFTER and b == 0x2C and (not props or self._next_keys(props, i)):
            return [rest + (("obj", n, i, NEED_KEY, 0),)]
        if phase in (OPEN, AFTER) and b == 0x7D and self._may_close(props, i):
            return self._complete(rest)
        return []

    def _key(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        _, n, candidates, pos = top
        props = self.nodes[n][1]
        keep = [j for j in candidates if props[j][0][pos] == b]
        # A key's bytes end with its closing quote, so at most one candidate ends here.
        out = [rest[:-1] + (("obj", n, j + 1, COLON, 0),) for j in keep if len(props[j][0]) == pos + 1]
        longer = tuple(j for j in keep if len(props[j][0]) > pos + 1)
        if longer:
            out.append(rest + (("key", n, longer, pos + 1),))
        return out

    def _array(self, rest: tuple, top: tuple, b: int) -> list[tuple]:
        _, n, count, phase, ws = top
        _, item, lo, hi = self.nodes[n]
        if b in WS:
            return [rest + (("arr", n, count, phase, ws + 1),)] if ws < MAX_WS else []
        if phase == OPEN:
            if b == 0x5D:
                return self._complete(rest) if lo == 0 else []
            return self._dispatch(rest + (("arr", n, count, VALUE, 0),), item, b) if hi != 0 else []
        if phase == AFTER:
            if b == 0x2C and (hi is None or count < hi):
                return [rest + (("arr", n, count, VALUE, 0), ("pre", item, 0))]
            if b == 0x5D and count >= lo:
                return self._complete(rest)
        return []
