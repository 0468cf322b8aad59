"""`python -m train`: see train/app.py."""

from train.app import main

if __name__ == "__main__":
    main()
