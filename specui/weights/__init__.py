"""Model preparation: everything between a name the user typed and a model ready to decode.

A hub id, a local folder or a GGUF is located and loaded (loading.py; a GGUF's own 4-bit
blocks in gguf_blocks.py, converted once into a cached folder by gguf_cache.py); weights are
rounded for the CPU kernels (quantize.py); the dtype, the quantization and the thread count are
chosen by timing real forwards on this machine (dtypes.py, quant_choice.py, threads.py); the
project's own draft model is built, saved and loaded (draft.py).

One package because these modules change together and are read together: they all answer
"what exactly did we load, and why". It sits above the engine: it times forwards with the
engine's sessions, and the engine never imports it (a loaded model is handed to the engine)."""
