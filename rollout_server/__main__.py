"""`python -m rollout_server [--config FILE] [key=value ...]`."""

from rollout_server.server import main

if __name__ == "__main__":
    main()
