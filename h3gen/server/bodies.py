"""Reading request bodies safely: bounded JSON (size and nesting), strict multipart (one value per field, text in
the form's charset, files stored by what their content decodes as), and the 4xx / 507 answers in one shape:
FastAPI's `detail` per field plus OpenAI's `error` object (its SDK shows `error.message`). Nothing here names a
server path: every message goes through `public_text`."""

import errno
import re
import sqlite3
from contextlib import aclosing
from pathlib import Path

from fastapi import HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from h3gen.errors import RequestError
from h3gen.media import upload_suffix
from h3gen.server.json_text import JsonRefused, parse_json
from h3gen.server.openai_video import error_body
from h3gen.server.schemas import UPLOAD_KINDS

MAX_JSON_BYTES = 64 * 1024
# A keyframe sent inside a JSON body as a base64 data URL (OpenAI's `input_reference.image_url`): parsing and decoding
# it holds the interpreter for a few milliseconds a megabyte, so it stays small; larger keyframes go as multipart
# uploads (up to --max-upload-mb).
MAX_DATA_URL_BYTES = 8 * 2**20


def json_body_limit(max_upload_bytes: int) -> int:
    """The most bytes a JSON body may hold: 64 KB besides a data URL of at most `MAX_DATA_URL_BYTES` (and of no
    more than the upload limit allows, at base64's 4/3)."""
    return MAX_JSON_BYTES + min(MAX_DATA_URL_BYTES, max_upload_bytes * 4 // 3)


# The directories of an absolute path (kept: its last part), not when part of a URL or a word like "processor/".
_SERVER_PATH = re.compile(r"(?<![\w.:/~-])(?:/[^/\s'\"()<>,;]+)+/")
DISK_FULL = "the server's disk is full, so the request could not be stored; try again later"
# OpenAI's SDK sends an `input_reference` object in a multipart body as these text parts.
INPUT_REFERENCE_PARTS = {"input_reference[image_url]": "image_url", "input_reference[file_id]": "file_id"}


def public_text(text: str | None) -> str | None:
    """`text` as a client may see it: absolute paths reduced to their file names (the server's folders stay
    private). Every message the API answers with goes through here."""
    return None if text is None else _SERVER_PATH.sub("", text)


def public_view(job: dict) -> dict:
    return {**job, "error": public_text(job.get("error"))}


def insufficient_storage() -> JSONResponse:
    return JSONResponse({"detail": DISK_FULL, "error": error_body(DISK_FULL, kind="server_error")}, status_code=507)


def disk_full(error: BaseException) -> bool:
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or (
        isinstance(error, sqlite3.OperationalError) and "full" in str(error)
    )


class _StrictMultiPartParser(MultiPartParser):
    """Starlette's parser, except that a text part which is not valid in the form's charset (UTF-8 unless the
    Content-Type says otherwise) is noted instead of being read as Latin-1, as JSON bodies refuse it too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.undecodable: list[str] = []

    def on_part_end(self) -> None:
        if self._current_part.file is None:
            try:
                self._current_part.data.decode(self._charset)
            except (UnicodeDecodeError, LookupError):
                self.undecodable.append(self._current_part.field_name)
        super().on_part_end()


async def json_object(request: Request, limit: int = MAX_JSON_BYTES, allowance=None) -> dict | JSONResponse:
    """The JSON object of a request body of at most `limit` bytes, or the 422 that says why there is none. With
    `allowance(data) -> bytes`, the body may exceed `MAX_JSON_BYTES` by those bytes only (an upload carried as a data
    URL); more is a 413."""
    body = await read_limited(request, limit)
    try:
        data = await run_in_threadpool(parse_json, body)  # off the event loop: /health answers meanwhile
    except JsonRefused as error:
        return field_error("body", str(error), "json_invalid")
    if not isinstance(data, dict):
        return field_error("body", "the body must be a JSON object", "model_type")
    if len(body) > MAX_JSON_BYTES and len(body) - (allowance(data) if allowance else 0) > MAX_JSON_BYTES:
        raise HTTPException(413, f"a JSON body may hold at most {MAX_JSON_BYTES} bytes besides an upload's data URL")
    return data


async def multipart_form(
    request: Request, limit: int, *, max_files: int, max_fields: int, text_limit: int = MAX_JSON_BYTES
):
    """The form of a multipart body no larger than `limit` bytes (411 without a Content-Length, 413 above it),
    each text part at most `text_limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is None:
        raise HTTPException(411, "multipart uploads need a Content-Length")
    if not declared.isdigit() or int(declared) > limit:
        raise HTTPException(413, f"request body larger than {limit} bytes")
    async with aclosing(request.stream()) as stream:
        parser = _StrictMultiPartParser(
            request.headers, stream, max_files=max_files, max_fields=max_fields, max_part_size=text_limit
        )
        try:
            form = await parser.parse()
        except MultiPartException as error:
            raise HTTPException(400, error.message) from None
    if parser.undecodable:
        await form.close()
        field = parser.undecodable[0]
        raise RequestError(f"{field} is not valid text in the form's charset ({parser._charset}).", field)
    return form


async def body_fields(
    request: Request,
    limit: int,
    *,
    max_files: int,
    max_fields: int,
    on_file,
    file_fields: tuple[str, ...] = (),
    text_limit: int = MAX_JSON_BYTES,
    json_allowance=None,
) -> dict | JSONResponse:
    """The fields of a JSON object body (at most `text_limit` bytes), or of a multipart body no larger than `limit`
    bytes whose files go to `await on_file(key, upload)` (which returns a 422 to stop, or None); a text value under
    one of `file_fields` is refused; OpenAI's `input_reference[...]` text parts become an `input_reference` object. A
    JSONResponse for a body that cannot be read; 415 for any other content type. `json_allowance`: see
    `json_object`."""
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("application/json"):
        return await json_object(request, text_limit, json_allowance)
    if not content_type.startswith("multipart/form-data"):
        raise HTTPException(415, "send application/json or multipart/form-data")
    form = await multipart_form(request, limit, max_files=max_files, max_fields=max_fields, text_limit=text_limit)
    data, seen = {}, set()
    try:
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                refusal = await on_file(key, value)
                if refusal is not None:
                    return refusal
            elif key in file_fields:
                return field_error(key, f"{key} must be a file upload")
            elif key in seen:
                return field_error(key, f"give {key} once (the form repeats it)")
            elif key in INPUT_REFERENCE_PARTS:
                seen.add(key)
                data.setdefault("input_reference", {})[INPUT_REFERENCE_PARTS[key]] = value
            else:
                seen.add(key)
                if value != "":
                    data[key] = value
    finally:
        await form.close()
    return data


def validated(schema, data: dict):
    """`schema` (a pydantic model) validated from `data`, or a 422 in FastAPI's own shape (locations under
    "body")."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        details = error.errors(include_url=False, include_context=False, include_input=False)
        for detail in details:
            detail["loc"] = ["body", *detail["loc"]]
        return invalid(jsonable_encoder(details))


def field_error(field: str, message: str, kind: str = "value_error") -> JSONResponse:
    return invalid([{"loc": ["body", field], "msg": public_text(message), "type": kind}])


def invalid(details: list[dict]) -> JSONResponse:
    """A 422 in FastAPI's shape (`detail`: one entry per field), with OpenAI's `error` object for the first."""
    first = details[0]
    field = ".".join(str(part) for part in first["loc"][1:]) or "body"
    message = str(first["msg"]).removeprefix("Value error, ")
    return JSONResponse({"detail": details, "error": error_body(f"{field}: {message}", field)}, status_code=422)


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HTTPException(413, f"request body larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"request body larger than {limit} bytes")
    return bytes(body)


def save_upload(upload: UploadFile, folder: Path, name: str, limit: int, field: str | None = None) -> Path:
    """Store one uploaded file as `<name><suffix>`, the suffix from what its content decodes as (never from the
    client's file name). Raises `RequestError` naming `field` for a file too large, empty, or not of the field's
    kind (`UPLOAD_KINDS`), and lets `OSError` through (the disk being full is answered with 507)."""
    field = field or name
    received = folder / f"{name}.upload"
    size = 0
    with open(received, "wb") as out:
        while chunk := upload.file.read(1 << 20):
            size += len(chunk)
            if size > limit:
                raise RequestError(f"{field} is larger than the {limit // 2**20} MB upload limit.", field)
            out.write(chunk)
    if size == 0:
        raise RequestError(f"{field} is an empty file.", field)
    target = folder / f"{name}{upload_suffix(received, UPLOAD_KINDS[field], field)}"
    received.replace(target)
    return target
