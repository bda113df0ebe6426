from .fault import RankLost, Watchdog
from .ring import Pending, Ring
from .stats import CommStats, comm_stats
from .topology import Topology

__all__ = ["Ring", "Pending", "CommStats", "comm_stats", "Topology", "RankLost", "Watchdog"]
