"""What the K3 engine keeps per request: its place in the scheduler (`Request`, whose `status` is one of WAITING,
PREFILL, DECODE, FINISHED), the output it streams (`RequestOutput`: text decoded a token at a time and held back
while it could still turn into a stop string), and a decode step launched before its tokens were read
(`InFlightDecode`)."""

from dataclasses import dataclass, field

import torch

from h3gen.pipelines.k3.engine.graphs import DecodeLaunch
from h3gen.pipelines.k3.engine.sampling import SamplingParams, sample

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request. `text` is the text so far; `delta` what is new since the last
    output (held back while it could still turn into a stop string)."""

    request_id: int
    delta: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos, stop token or string), "length", "error"
    error: str | None = None


@dataclass(eq=False)
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    images: object = None  # ProcessedImages
    output_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    computed: int = 0  # tokens whose MLA rows and KDA state exist
    target: int = 0  # prefill runs until `computed == target`
    fork: int = 0  # where the prompt left the prefix cache (a checkpoint is taken there)
    checkpoints: dict[int, int] = field(default_factory=dict)
    generator: torch.Generator | None = None
    embeds: torch.Tensor | None = None  # prompt embeddings when images are given
    sent: int = 0  # characters of text already streamed
    text: str = ""
    text_bytes: bytearray = field(default_factory=bytearray)  # the output's bytes, one token appended per step
    finish_reason: str | None = None
    error: str | None = None
    preemptions: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, position: int) -> int:
        """`all_ids[position]` without building the list (a decode step reads one token of a long sequence)."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[position] if position < prompt else self.output_ids[position - prompt]

    def text_after(self, tokenizer, token: int | None) -> str:
        """The output's text after `token` (None: nothing new): the token's bytes appended to the request's, so
        a step decodes its bytes once instead of detokenizing the whole output again (tokenizers without
        `token_bytes` do the latter)."""
        piece = getattr(tokenizer, "token_bytes", None)
        if piece is None:
            return tokenizer.decode(self.output_ids, skip_special=True)
        if token is not None:
            self.text_bytes += piece(token, skip_special=True)
        return self.text_bytes.decode("utf-8", errors="replace")

    def take_output(self) -> RequestOutput:
        """The output to stream now: the text so far and what is new since the last output (`sent` moves past it).
        While the request runs, the tail that could still turn into a stop string and an incomplete UTF-8 sequence
        are held back."""
        text = self.text
        visible = len(text)
        if self.status != FINISHED:
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            visible = max(self.sent, len(text) - hold)
            while visible > self.sent and text[visible - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                visible -= 1
        delta = text[self.sent : visible]
        self.sent = max(self.sent, visible)
        return RequestOutput(
            self.id,
            delta,
            text,
            list(self.output_ids),
            self.status == FINISHED,
            self.finish_reason,
            self.error,
        )


@dataclass
class InFlightDecode:
    """A launched decode step: its requests and, per request, `(computed, preemptions)` at launch (the position
    the step decodes), so its token is only taken if the request is still where the step left it."""

    launch: DecodeLaunch
    requests: list[Request]
    marks: list[tuple[int, int]]

    @staticmethod
    def still_valid(request: Request, mark: tuple[int, int]) -> bool:
        return request.status == DECODE and (request.computed, request.preemptions) == mark

    def sample_valid(self) -> list[int | None]:
        """The step's tokens drawn on the host, only for the requests still where the step left them (a dropped
        row must not advance its request's generator: a preempted request resumes with the same sampler state)."""
        rows = [i for i, (r, m) in enumerate(zip(self.requests, self.marks, strict=True)) if self.still_valid(r, m)]
        chosen: list[int | None] = [None] * len(self.requests)
        if not rows:
            return chosen
        logits, argmax = self.launch.logits, self.launch.argmax
        if len(rows) < len(self.requests):
            index = torch.tensor(rows, device=logits.device)
            logits, argmax = logits[index], argmax[index]
        requests = [self.requests[i] for i in rows]
        for i, token in zip(
            rows, sample(logits, [r.params for r in requests], [r.generator for r in requests], argmax), strict=True
        ):
            chosen[i] = token
        return chosen
