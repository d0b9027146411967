"""The K3 tokenizer (Kimi's tiktoken BPE) and its XTML chat encoding, without the `tiktoken` package.

Files read from the checkpoint folder:
- `tiktoken.model`: one `base64(token bytes) rank` per line; the rank is the token id and the merge priority.
- `tokenizer_config.json`: `added_tokens_decoder` names the 256 special ids that follow the BPE vocabulary (the
  unnamed ones are `<|reserved_token_{id}|>`), and `bos_token` / `eos_token`.

Text is split with Kimi's pre-tokenisation pattern, then each piece's bytes are merged pair by pair, lowest rank
first (tiktoken's algorithm). Chat messages render as XTML: `<|open|>message role="user"<|sep|>...<|close|>message
<|sep|><|end_of_msg|>`; structural markers are special tokens, message text never is (a user who types `<|open|>`
gets its bytes).
"""

import base64
import json
from pathlib import Path

import regex

from h3gen.errors import CheckpointError

NUM_SPECIAL = 256
PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_PAD = "<|media_pad|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_end|>"
THINKING_EFFORTS = ("low", "high", "max")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing.") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise CheckpointError(f"{path}:{number} is not '<base64 token> <rank>'.") from None
    return ranks


class K3Tokenizer:
    def __init__(
        self, ranks: dict[bytes, int], special_names: dict[int, str], bos_token: str = "[BOS]", eos_token: str = "[EOS]"
    ):
        self.ranks = ranks
        self.decoder = {rank: token for token, rank in ranks.items()}
        base = len(ranks)
        if sorted(self.decoder) != list(range(base)):
            raise CheckpointError("tiktoken.model ranks must be 0..N-1, each once.")
        self.special = {special_names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL)}
        self.special_by_id = {i: name for name, i in self.special.items()}
        self.vocab_size = base + NUM_SPECIAL
        self.bos_token_id, self.eos_token_id = self.special.get(bos_token), self.special.get(eos_token)
        self._split = regex.compile(PATTERN, flags=regex.V1)
        names = sorted(self.special, key=len, reverse=True)
        self._special_split = regex.compile("(" + "|".join(regex.escape(n) for n in names) + ")")

    @classmethod
    def from_folder(cls, folder) -> "K3Tokenizer":
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        names = {int(i): entry["content"] for i, entry in (config.get("added_tokens_decoder") or {}).items()}

        def token(value, default):
            return (value.get("content") if isinstance(value, dict) else value) or default

        return cls(
            read_tiktoken_ranks(folder / "tiktoken.model"),
            names,
            token(config.get("bos_token"), "[BOS]"),
            token(config.get("eos_token"), "[EOS]"),
        )

    def token_id(self, name: str) -> int:
        if name not in self.special:
            raise KeyError(f"{name} is not a special token of this tokenizer.")
        return self.special[name]

    def _bpe(self, piece: bytes) -> list[int]:
        if piece in self.ranks:
            return [self.ranks[piece]]
        parts = [piece[i : i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best, where = None, -1
            for i in range(len(parts) - 1):
                rank = self.ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best is None or rank < best):
                    best, where = rank, i
            if best is None:
                break
            parts[where : where + 2] = [parts[where] + parts[where + 1]]
        return [self.ranks[part] for part in parts]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; with `allow_special`, special-token strings become their ids."""
        ids = []
        chunks = self._special_split.split(text) if allow_special else [text]
        for index, chunk in enumerate(chunks):
            if allow_special and index % 2 == 1:
                ids.append(self.special[chunk])
                continue
            for piece in self._split.findall(chunk):
                ids += self._bpe(piece.encode("utf-8"))
        return ids

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes one token stands for (a special token's name, or nothing with `skip_special`)."""
        token_id = int(token_id)
        if token_id in self.decoder:
            return self.decoder[token_id]
        return b"" if skip_special else self.special_by_id[token_id].encode()

    def decode(self, ids, skip_special: bool = False) -> str:
        return b"".join(self.token_bytes(i, skip_special) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        thinking: bool = True,
        thinking_effort: str | None = "max",
        image_prompts: list[str] | None = None,
        tokenize: bool = True,
    ):
        """Render `messages` (roles system/developer/user/assistant; string content or parts with `type` "text" /
        "image") as K3's XTML and return token ids (or the text with `tokenize=False`). Each image becomes the next
        of `image_prompts` (default `<|media_pad|>`). Tool declarations and tool calls are not rendered yet."""
        segments = render_chat(messages, add_generation_prompt, thinking, thinking_effort, image_prompts)
        if not tokenize:
            return "".join(text for text, _ in segments)
        ids = []
        for text, special in segments:
            ids += self.encode(text, allow_special=special)
        return ids

    def expand_images(self, ids: list[int], num_tokens: list[int], image_sizes: list[tuple[int, int]]) -> list[int]:
        """Expand the template's one `<|media_pad|>` per image into the checkpoint's media span:
        `<|media_begin|>image {W}x{H}<|media_content|>` + `<|media_pad|>` x N + `<|media_end|>`, with W x H the
        original upload size and N the image's token count (`K3ImageProcessor` gives both)."""
        pad = self.token_id(MEDIA_PAD)
        found = sum(1 for i in ids if i == pad)
        if found != len(num_tokens) or len(image_sizes) != len(num_tokens):
            raise ValueError(
                f"the prompt has {found} image placeholders but {len(num_tokens)} images were given "
                f"({len(image_sizes)} sizes)."
            )
        out, image = [], 0
        for i in ids:
            if i != pad:
                out.append(i)
                continue
            width, height = image_sizes[image]
            out += self.encode(f"{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}")
            out += [pad] * num_tokens[image] + [self.token_id(MEDIA_END)]
            image += 1
        return out


def render_chat(messages, add_generation_prompt=True, thinking=True, thinking_effort="max", image_prompts=None):
    """`[(text, is_control)]`: control segments are tokenised with special tokens, text segments without."""
    images = list(image_prompts) if image_prompts is not None else None
    used = 0
    out: list[tuple[str, bool]] = []

    def control(text):
        out.append((text, True))

    def text(value):
        if value:
            out.append((str(value), False))

    def open_tag(tag, attrs=()):
        control(OPEN)
        text(
            tag
            + "".join(f' {key}="{str(value).replace("&", "&amp;").replace(chr(34), "&quot;")}"' for key, value in attrs)
        )
        control(SEP)

    def close_tag(tag):
        control(CLOSE)
        text(tag)
        control(SEP)

    def image():
        nonlocal used
        if images is None:
            control(MEDIA_PAD)
            return
        if used >= len(images):
            raise ValueError("more images in the messages than image_prompts.")
        control(images[used])
        used += 1

    def content(value):
        parts = [{"type": "text", "text": value}] if isinstance(value, str) else (value or [])
        for part in parts:
            if part["type"] in ("image", "image_url"):
                image()
                continue
            pieces = part["text"].split(IMAGE_PLACEHOLDER) if images is not None else [part["text"]]
            for index, piece in enumerate(pieces):
                text(piece)
                if index < len(pieces) - 1:
                    image()

    def system_note(kind, body):
        open_tag("message", [("role", "system"), ("type", kind)])
        text(body.strip())
        close_tag("message")
        control(END_OF_MSG)

    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ValueError(f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)} (got {thinking_effort!r}).")
        system_note(
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking channel (not including the "
            "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={thinking_effort}`.",
        )
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        if role in ("user", "system"):
            attrs = [("role", role)] + ([("name", message["name"])] if message.get("name") else [])
            open_tag("message", attrs)
            content(message.get("content"))
        elif role == "assistant":
            open_tag("message", [("role", "assistant")])
            if thinking:
                open_tag("think")
                reasoning = message.get("reasoning_content") or message.get("reasoning")
                if reasoning and str(reasoning).strip():
                    text(reasoning)
                close_tag("think")
            open_tag("response")
            content(message.get("content"))
            close_tag("response")
        else:
            raise ValueError(f"message role {message['role']!r} is not supported (system, developer, user, assistant).")
        close_tag("message")
        control(END_OF_MSG)
    if add_generation_prompt:
        open_tag("message", [("role", "assistant")])
        open_tag("think" if thinking else "response")
    if images is not None and used != len(images):
        raise ValueError(f"{len(images)} image_prompts but {used} images in the messages.")
    return out
