import os

# transformers prints "PyTorch was not found. Models won't be available..." at import: jaxspec uses only its
# tokenizers and converters, which need no torch. Advisory notes only; its warnings and errors still show.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
