"""JSON text from clients, parsed in bounded time: request bodies and the JSON that form fields and string fields
carry (`loras`, `cache`, `prompts`).

A request is a flat object. Before anything is parsed, the structural characters are counted (`bytes.count` at
memory speed, a megabyte at a time), so a body of millions of tiny values is refused without building them; a long
string (a base64 image) costs what copying it costs. Nesting deeper than `MAX_JSON_DEPTH` is refused after parsing
(the parser itself stops at Python's recursion limit, which is caught).
"""

import json
import sys

MAX_JSON_DEPTH = 32
# Structural characters a request may hold: a flat object of a few dozen fields, lists of up to 64 prompts or 8
# adapters, with room for commas and colons inside its strings.
MAX_JSON_TOKENS = 65_536
_STRUCTURAL = (b"[", b"{", b",", b":")


class JsonRefused(ValueError):
    """JSON text that is not valid, too deep or too large to parse; the message says which."""


def parse_json(text: bytes | str, what: str = "the body") -> object:
    """The value of a JSON text of a client, or `JsonRefused` naming `what`.

    Args:
        text: the JSON (UTF-8 bytes or str), already bounded in size by whoever read it.
        what: how the message names the text ("the body", "loras").
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if structural_count(data) > MAX_JSON_TOKENS:
        raise JsonRefused(f"{what} holds more than {MAX_JSON_TOKENS} JSON values")
    try:
        value = json.loads(data)
    except RecursionError:
        raise JsonRefused(f"{what} nests arrays or objects more than {MAX_JSON_DEPTH} deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise JsonRefused(f"{what} is not valid JSON") from None
    except ValueError:  # an integer past Python's digit limit
        raise JsonRefused(f"a number in {what} has more than {sys.get_int_max_str_digits()} digits") from None
    if depth(value) > MAX_JSON_DEPTH:
        raise JsonRefused(f"{what} nests arrays or objects more than {MAX_JSON_DEPTH} deep")
    return value


def structural_count(data: bytes, step: int = 1 << 20) -> int:
    """How many of `[`, `{`, `,` and `:` `data` holds, counted a megabyte at a time: each count holds the GIL for
    a fraction of a millisecond, so the server's other threads and its event loop run in between."""
    return sum(data.count(char, start, start + step) for start in range(0, len(data), step) for char in _STRUCTURAL)


def depth(value: object) -> int:
    """How deep lists and dicts nest in `value` (0 for a scalar), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        pending.extend((child, level + 1) for child in children)
    return deepest
