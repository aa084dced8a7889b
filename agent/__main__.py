import sys

from gearshift.agent.main import main

sys.exit(main())
