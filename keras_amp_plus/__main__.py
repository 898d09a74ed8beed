"""`python -m keras_amp_plus`: see `keras_amp_plus.cli`."""

import sys

from keras_amp_plus.cli import main

if __name__ == "__main__":
    sys.exit(main())
