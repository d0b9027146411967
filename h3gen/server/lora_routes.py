"""`GET /v1/loras`: the adapters of the server's LoRA folder (`--lora-dir`), which requests name in `loras`."""

from fastapi import FastAPI

from h3gen.server.bodies import public_text
from h3gen.server.schemas import LoraList


def add_lora_routes(app: FastAPI, server) -> None:
    """Add `GET /v1/loras` to `app`, behind the API key; `server` is the app's `ServerContext`."""
    manager = server.manager

    @app.get("/v1/loras", response_model=LoraList)
    def list_loras():
        """The adapters requests may name: name, file size, format, rank, alpha, partition and the few-step recipe
        each brings (empty without --lora-dir)."""
        folder = getattr(manager.engine, "lora_folder", None)
        entries = folder.listing() if folder is not None else []
        return {"object": "list", "data": [entry | {"error": public_text(entry.get("error"))} for entry in entries]}
