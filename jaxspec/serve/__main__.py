import sys

from jaxspec.serve.cli import main

sys.exit(main())
