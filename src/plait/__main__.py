from plait.cli import main
from plait.exiting import exit_now

exit_now(main())
