from ntx.daemons.dma.daemon import DmaDaemon
from ntx.shared.daemon import daemon_main

daemon_main(DmaDaemon)
