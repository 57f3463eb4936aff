"""`python -m glmq ...` and `torchrun -m glmq ...` enter the same click CLI as the `glmq` script."""

from glmq.scripts.cli import main

if __name__ == "__main__":
    main()
