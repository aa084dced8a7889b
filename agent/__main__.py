import sys

from agent.agent import main

sys.exit(main())
