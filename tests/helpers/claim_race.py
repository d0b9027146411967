"""One worker process of the claim race (tests/test_job_store_backends.py): opens the job store at argv[1], prints
"ready", waits for a line on stdin, then claims jobs as worker argv[2] until none is left and prints their ids as one
JSON list."""

import json
import sys

from h3gen.server.store import open_store

store = open_store(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
claimed = []
while (job := store.claim(sys.argv[2], lambda needs: True, 60.0)) is not None:
    claimed.append(job.id)
store.close()
print(json.dumps(claimed), flush=True)
