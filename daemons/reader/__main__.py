from ntx.daemons.reader.daemon import ReaderDaemon
from ntx.shared.daemon import daemon_main

daemon_main(ReaderDaemon)
