/*
 * streamcoll: oneCCL C API declarations for cffi (ABI mode).
 *
 * Source: oneCCL 2022.2.0, include/oneapi/ccl.h and include/oneapi/ccl/v2/types.h
 * as shipped in the oneccl-cpu-devel 2022.2.0 wheel (ONECCL_VERSION_CODE 20220200).
 * Trimmed to what cffi's cdef parses: no #include/#define/attributes, the
 * anonymous union of onecclUniqueId kept, enum expressions written as the
 * values they evaluate to. tests/binding/test_abi.py compiles native/abi_check.c (as
 * C++: types.h includes <cstddef>) against the real header and compares every
 * size, field offset, enum value and function signature below with cffi's.
 *
 * Functions the header marks CCL_C_NOT_IMPLEMENTED (onecclCommInitAll,
 * onecclCommAbort, onecclCommGetAsyncError) are declared so the binding is
 * complete; streamcoll does not call them.
 */
typedef struct onecclComm *onecclComm_t;
typedef void *onecclWindow_t;

typedef struct {
    void *opaque[8];
} onecclDevComm_t;

typedef struct {
    int lsa_barrier_count;
} onecclDevCommRequirements_t;

typedef enum {
    ONECCL_WINDOW_DEFAULT = 0,
    ONECCL_WINDOW_COLL_SYMMETRIC = 1
} onecclWindowFlags_t;

typedef enum {
    onecclSuccess = 0,
    onecclError = 1,
    onecclSystemError = 2,
    onecclInternalError = 3,
    onecclInvalidArgument = 4,
    onecclInvalidUsage = 5,
    onecclInProgress = 6,
    onecclFailureGPU = 7,
    onecclFailureCPU = 8,
    onecclAllocFailureCPU = 9,
    onecclAllocFailureGPU = 10,
    onecclPluginException = 11,
    onecclNotImplemented = 12
} onecclResult_t;

typedef enum {
    onecclInt8 = 0,
    onecclChar = 0,
    onecclUint8 = 1,
    onecclInt32 = 2,
    onecclInt = 2,
    onecclUint32 = 3,
    onecclInt64 = 4,
    onecclUint64 = 5,
    onecclFloat16 = 6,
    onecclHalf = 6,
    onecclFloat32 = 7,
    onecclFloat = 7,
    onecclFloat64 = 8,
    onecclDouble = 8,
    onecclBfloat16 = 9
} onecclDataType_t;

typedef enum { onecclNumOps_dummy = 5 } onecclRedOp_dummy_t;

typedef enum {
    onecclSum = 0,
    onecclProd = 1,
    onecclMax = 2,
    onecclMin = 3,
    onecclAvg = 4,
    onecclNumOps = 5,
    onecclMaxRedOp = 2147483647
} onecclRedOp_t;

typedef enum {
    onecclScalarDevice = 0,
    onecclScalarHostImmediate = 1
} onecclScalarResidence_t;

typedef enum {
    onecclPluginAny = 0,
    onecclNull = 0xDEADBEEF,
    onecclLegacy = 0xBAAAAAAD,
    onecclLegacyCPU = 0xBAAAAAAE,
    onecclUserBackend = 0xF8F8F8F8
} onecclPluginType_t;

/* The header's onecclUniqueId is a union of {legacy[512], nccl[512],
 * any[2048]} with data[4096]. cffi cannot pass a struct holding an anonymous
 * union by value in ABI mode, so only the data[4096] member is declared: same
 * size (4096), alignment (1) and x86-64 calling convention (a struct over 16
 * bytes of class MEMORY, copied to the stack). The ABI check compares size,
 * alignment and the offset of data with the real header. */
typedef struct {
    char data[4096];
} onecclUniqueId;

typedef struct onecclConfig {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;
    int multiThreaded;
    onecclPluginType_t plugin;
} onecclConfig_t;

/* Version and ids */
onecclResult_t onecclGetVersion(int *version);
onecclResult_t onecclGetUniqueId(onecclUniqueId *uniqueId);
onecclResult_t onecclExtractVersionComponents(int versionCode, int *major, int *minor, int *patch);

/* Communicator life cycle */
onecclResult_t onecclCommInitRank(onecclComm_t *comm, size_t nranks, onecclUniqueId commId, int rank);
onecclResult_t onecclCommInitRankConfig(onecclComm_t *comm, size_t nranks, onecclUniqueId commId, int rank, const onecclConfig_t *config);
onecclResult_t onecclCommInitAll(onecclComm_t *comm, int ndev, const int *devlist);
onecclResult_t onecclCommFinalize(onecclComm_t comm);
onecclResult_t onecclCommDestroy(onecclComm_t comm);
onecclResult_t onecclCommAbort(onecclComm_t comm);
onecclResult_t onecclCommSplit(onecclComm_t comm, int color, int key, onecclComm_t *newcomm, onecclConfig_t *config);

/* Errors and debugging */
const char *onecclGetErrorString(onecclResult_t result);
const char *onecclGetLastError(onecclComm_t comm);
void onecclDebugInit(void);
void onecclResetDebugInit(void);
onecclResult_t onecclCommGetAsyncError(onecclComm_t comm);

/* Queries */
onecclResult_t onecclCommCount(const onecclComm_t comm, int *size);
onecclResult_t onecclCommDevice(const onecclComm_t comm, int *device);
onecclResult_t onecclCommUserRank(const onecclComm_t comm, int *rank);
onecclResult_t onecclSetDevice(uint32_t index);

/* Memory, registration, windows, device communicators */
onecclResult_t onecclMemAlloc(void **ptr, size_t size);
onecclResult_t onecclMemFree(void *ptr);
onecclResult_t onecclCommRegister(onecclComm_t comm, void *buff, size_t size, void **handle);
onecclResult_t onecclCommDeregister(onecclComm_t comm, void *handle);
onecclResult_t onecclCommWindowRegister(onecclComm_t comm, void *buff, size_t size, onecclWindow_t *window, onecclWindowFlags_t flags);
onecclResult_t onecclCommWindowDeregister(onecclComm_t comm, onecclWindow_t window);
onecclResult_t onecclDevCommCreate(onecclComm_t comm, const onecclDevCommRequirements_t *reqs, onecclDevComm_t *dev_comm);
onecclResult_t onecclDevCommDestroy(onecclComm_t comm, const onecclDevComm_t *dev_comm);
onecclResult_t onecclGetPeerDevicePointer(onecclWindow_t window, size_t offset, int peer, void **out_ptr);
onecclResult_t onecclGetLsaDevicePointer(onecclWindow_t window, size_t offset, int lsa_peer, void **out_ptr);
onecclResult_t onecclGetLocalDevicePointer(onecclWindow_t window, size_t offset, void **out_ptr);

/* Collectives; stream is a sycl::queue* for Intel GPUs, NULL for host buffers */
onecclResult_t onecclReduce(const void *sendbuff, void *recvbuff, size_t count, onecclDataType_t datatype, onecclRedOp_t redop, int root, onecclComm_t comm, void *stream);
onecclResult_t onecclAllReduce(void *sendbuff, void *recvbuff, size_t count, onecclDataType_t datatype, onecclRedOp_t reduction_op, onecclComm_t comm, void *stream);
onecclResult_t onecclBroadcast(const void *sendbuff, void *recvbuff, size_t count, onecclDataType_t datatype, int root, onecclComm_t comm, void *stream);
onecclResult_t onecclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, onecclDataType_t datatype, onecclRedOp_t redop, onecclComm_t comm, void *stream);
onecclResult_t onecclScatter(const void *sendbuff, void *recvbuff, size_t count, onecclDataType_t datatype, int root, onecclComm_t comm, void *stream);
onecclResult_t onecclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, onecclDataType_t datatype, onecclComm_t comm, void *stream);
onecclResult_t onecclAllToAll(const void *sendbuff, void *recvbuff, size_t count, onecclDataType_t datatype, onecclComm_t comm, void *stream);
onecclResult_t onecclAllToAllV(const void *sendbuff, const size_t *send_counts, void *recvbuff, const size_t *recv_counts, onecclDataType_t datatype, onecclComm_t comm, void *stream);

/* Point to point and groups */
onecclResult_t onecclSend(const void *sendbuff, size_t count, onecclDataType_t datatype, int peer, onecclComm_t comm, void *stream);
onecclResult_t onecclRecv(void *recvbuff, size_t count, onecclDataType_t datatype, int peer, onecclComm_t comm, void *stream);
onecclResult_t onecclGroupStart(void);
onecclResult_t onecclGroupEnd(void);

/* Reduction operators */
onecclResult_t onecclRedOpCreatePreMulSum(onecclRedOp_t *redop, void *scalar, onecclDataType_t datatype, onecclScalarResidence_t residence, onecclComm_t comm);
onecclResult_t onecclRedOpDestroy(onecclRedOp_t redop, onecclComm_t comm);
