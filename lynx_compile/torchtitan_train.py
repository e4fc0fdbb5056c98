"""The kept command-line entry ``python -m lynx_compile.torchtitan_train`` (torchtitan's training
step under ``torchrun``): it runs :func:`lynx_compile.tools.torchtitan_train.main`. The code, and
every name to import, is in :mod:`lynx_compile.tools.torchtitan_train`."""

if __name__ == "__main__":
    import os
    import sys

    from lynx_compile.tools.torchtitan_train import main

    code = main()
    # The run's work is done and its process group destroyed: leave without interpreter
    # finalization. Under load (two 2-rank runs on 2 cores), a rank aborted in finalization after
    # its last step, "terminate called without an active exception" (exit -6, no Python frame
    # left: a C++ thread torn down with the interpreter), failing a run whose results were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
