"""The Win32 calls of :mod:`xpukit._platform`, through ``ctypes`` (``ctypes.windll`` exists only on
Windows): the memory status (``GlobalMemoryStatusEx``), the process's peak working set
(``GetProcessMemoryInfo``) and whether a process still runs (``OpenProcess``,
``GetExitCodeProcess``). Only :mod:`xpukit._platform` calls them, on Windows; a test simulating
Windows replaces them there (docs/windows.md).
"""

from __future__ import annotations

__all__ = ["memory", "peak_working_set", "process_alive"]


def memory() -> tuple[int, int]:
    """``(total, available)`` bytes of RAM (``GlobalMemoryStatusEx``); ``(0, 0)`` when it fails."""
    import ctypes
    from ctypes import wintypes

    class MemoryStatusEx(ctypes.Structure):
        _fields_ = [  # MEMORYSTATUSEX (sysinfoapi.h)
            ("dwLength", wintypes.DWORD),
            ("dwMemoryLoad", wintypes.DWORD),
            ("ullTotalPhys", ctypes.c_ulonglong),
            ("ullAvailPhys", ctypes.c_ulonglong),
            ("ullTotalPageFile", ctypes.c_ulonglong),
            ("ullAvailPageFile", ctypes.c_ulonglong),
            ("ullTotalVirtual", ctypes.c_ulonglong),
            ("ullAvailVirtual", ctypes.c_ulonglong),
            ("ullAvailExtendedVirtual", ctypes.c_ulonglong),
        ]

    status = MemoryStatusEx()
    status.dwLength = ctypes.sizeof(MemoryStatusEx)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):  # type: ignore[attr-defined]
        return 0, 0
    return int(status.ullTotalPhys), int(status.ullAvailPhys)


def peak_working_set() -> int | None:
    """This process's peak working set in bytes (``GetProcessMemoryInfo``); ``None`` when it fails."""
    import ctypes
    from ctypes import wintypes

    class ProcessMemoryCounters(ctypes.Structure):
        _fields_ = [  # PROCESS_MEMORY_COUNTERS (psapi.h)
            ("cb", wintypes.DWORD),
            ("PageFaultCount", wintypes.DWORD),
            ("PeakWorkingSetSize", ctypes.c_size_t),
            ("WorkingSetSize", ctypes.c_size_t),
            ("QuotaPeakPagedPoolUsage", ctypes.c_size_t),
            ("QuotaPagedPoolUsage", ctypes.c_size_t),
            ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t),
            ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
            ("PagefileUsage", ctypes.c_size_t),
            ("PeakPagefileUsage", ctypes.c_size_t),
        ]

    counters = ProcessMemoryCounters()
    counters.cb = ctypes.sizeof(ProcessMemoryCounters)
    kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
    process = kernel32.GetCurrentProcess()
    if not ctypes.windll.psapi.GetProcessMemoryInfo(process, ctypes.byref(counters), counters.cb):  # type: ignore[attr-defined]
        return None
    return int(counters.PeakWorkingSetSize)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (``OpenProcess``, then its exit code)."""
    import ctypes

    kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return bool(kernel32.GetLastError() == 5)  # ERROR_ACCESS_DENIED: it exists
    try:
        code = ctypes.c_ulong()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)
