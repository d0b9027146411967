"""The HTTP service: FastAPI app, job manager, SQLite job store, schemas, auth and metrics."""
