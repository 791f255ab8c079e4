from ntx.daemons.compute.daemon import ComputeDaemon
from ntx.shared.daemon import daemon_main

daemon_main(ComputeDaemon)
