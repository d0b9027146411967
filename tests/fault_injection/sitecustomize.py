"""A failure injected into the ranks of a test server (`h3gen serve --ulysses 2` under torchrun).

Python imports `sitecustomize` at start-up from the first folder on its path that has one: a test puts this folder
on the server's PYTHONPATH, which torchrun's ranks inherit. With `H3GEN_TEST_FAULT="rank=R,step=N,prompt=WORD"`,
rank R's local check fails at denoising step N of jobs whose prompt contains WORD, inside the ranks' step agreement
(`h3gen.server.distributed.StepAgreement`), where a real failure of that rank would surface.
"""

import os

SPEC = os.environ.get("H3GEN_TEST_FAULT")

if SPEC and "RANK" in os.environ:  # torchrun's ranks only, not the launcher
    from h3gen.server import distributed

    fields = dict(part.split("=", 1) for part in SPEC.split(","))
    rank = int(os.environ["RANK"])
    agree = distributed.StepAgreement.__call__

    def _agree_with_fault(self, local_check, prompt, stage, step):
        if (
            rank == int(fields["rank"])
            and stage == "denoise"
            and step == int(fields["step"])
            and fields["prompt"] in prompt
        ):

            def local_check(check=local_check):
                check()
                raise RuntimeError(f"injected failure on rank {rank} at step {step}")

        agree(self, local_check, prompt, stage, step)

    distributed.StepAgreement.__call__ = _agree_with_fault
