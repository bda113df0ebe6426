from .fault import RankLost, Watchdog
from .ring import Pending, Ring
from .stats import CommStats, comm_stats

__all__ = ["Ring", "Pending", "CommStats", "comm_stats", "RankLost", "Watchdog"]
