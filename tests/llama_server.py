"""Start llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`).

Same arguments as the server. One change, where it is needed: on CPUs with AMX, llama.cpp's
weight repacking in llama-cpp-python 0.3.36 crashes on the first batch of more than one token
(see runners/probe.py), and the server has no option to turn it off, so it is turned off here
where llmrun's own probe finds it unsafe for the model given with --model.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

import llama_cpp
import llama_cpp.llama

from llmrun.runners.gguf import read_gguf
from llmrun.runners.probe import repack_verdict

_model = sys.argv[sys.argv.index("--model") + 1]
if not repack_verdict(_model, read_gguf(_model).quantization).safe:
    _default_params = llama_cpp.llama_model_default_params

    def _params() -> Any:
        params = _default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_model_default_params = _params
    llama_cpp.llama.llama_cpp.llama_model_default_params = _params

sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
