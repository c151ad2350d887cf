/* Optional compiled fast path of the block-hash chain (kvservice_client.hashing).
 *
 * extend(block_hashes, token_ids, start, end, block_size, parent, layout) appends
 *     hash[i] = SHA-256(encode((parent, tuple(token_ids[i*bs:(i+1)*bs]), None)))
 * for blocks start..end-1 to the list block_hashes, chaining parent, where encode is
 *     layout 0: canonical CBOR (RFC 8949 section 4.2.1), as cbor2.dumps(..., canonical=True);
 *     layout 1: pickle protocol 5, as pickle.dumps(..., protocol=5) (Python's C pickler).
 * chain_packed(data, block_size, parent, layout) returns the same hashes, as a new list, for every full
 * block of little-endian int32 token ids (a packed prompt's bytes), reading no Python int.
 * Both release the GIL while they hash 64 blocks or more, so a thread can hash beside the interpreter.
 * Only blocks without extra keys take this path. The pure-Python rule in hashing.py is the
 * reference: tests compare both byte for byte (the vLLM vectors and random prompts).
 *
 * Raises ValueError, appending nothing, when a token id is outside the range this encoder
 * covers (CBOR: 0..2^32-1; pickle: 0..2^31-1), when the parent is not 32 bytes, or when one
 * block's encoding would pass 60,000 bytes (pickle frames larger objects differently); the
 * caller then takes the reference path.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <pythread.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 32
#define MAX_PAYLOAD 60000

static size_t cbor_uint(unsigned char *p, int major, uint64_t v) {
    unsigned char m = (unsigned char)(major << 5);
    if (v < 24) { p[0] = m | (unsigned char)v; return 1; }
    if (v < 0x100) { p[0] = m | 24; p[1] = (unsigned char)v; return 2; }
    if (v < 0x10000) { p[0] = m | 25; p[1] = (unsigned char)(v >> 8); p[2] = (unsigned char)v; return 3; }
    if (v < 0x100000000ULL) {
        p[0] = m | 26; p[1] = (unsigned char)(v >> 24); p[2] = (unsigned char)(v >> 16);
        p[3] = (unsigned char)(v >> 8); p[4] = (unsigned char)v; return 5;
    }
    p[0] = m | 27;
    for (int k = 0; k < 8; k++) p[1 + k] = (unsigned char)(v >> (56 - 8 * k));
    return 9;
}

static size_t pickle_int(unsigned char *p, uint32_t v) {
    if (v <= 0xff) { p[0] = 'K'; p[1] = (unsigned char)v; return 2; }
    if (v <= 0xffff) { p[0] = 'M'; p[1] = (unsigned char)v; p[2] = (unsigned char)(v >> 8); return 3; }
    p[0] = 'J'; p[1] = (unsigned char)v; p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)(v >> 16); p[4] = (unsigned char)(v >> 24); return 5;
}

/* The chain over ids already checked to be in the layout's range: digests[i] (32 bytes each) of
 * blocks 0..nblocks-1 of ids, chained from parent. Touches no Python object: callers release the
 * GIL around it. Returns -1 when out of memory. */
static int hash_blocks(const uint32_t *ids, Py_ssize_t nblocks, Py_ssize_t block_size, const unsigned char *parent_in,
                       int layout, unsigned char *digests) {
    size_t cap = (size_t)block_size * 5 + 64;
    unsigned char *buf = malloc(cap);
    if (buf == NULL) return -1;
    /* The fixed part before the parent digest, and where the parent goes. */
    size_t parent_at, body_at;
    if (layout == 0) {
        buf[0] = 0x83; buf[1] = 0x58; buf[2] = DIGEST;  /* array(3), bytes(32) */
        parent_at = 3;
        body_at = parent_at + DIGEST + cbor_uint(buf + parent_at + DIGEST, 4, (uint64_t)block_size);
    } else {
        buf[0] = 0x80; buf[1] = 5; buf[2] = 0x95;  /* PROTO 5, FRAME <8 bytes> */
        buf[11] = 'C'; buf[12] = DIGEST;            /* SHORT_BINBYTES 32 */
        parent_at = 13;
        body_at = parent_at + DIGEST;
        buf[body_at++] = 0x94;                      /* MEMOIZE */
        if (block_size > 3) buf[body_at++] = '(';   /* MARK */
    }
    const unsigned char *parent = parent_in;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        unsigned char *p = buf + body_at;
        const uint32_t *block = ids + i * block_size;
        if (layout == 0) {
            for (Py_ssize_t k = 0; k < block_size; k++) p += cbor_uint(p, 0, block[k]);
            *p++ = 0xf6;  /* None */
        } else {
            for (Py_ssize_t k = 0; k < block_size; k++) p += pickle_int(p, block[k]);
            *p++ = block_size == 1 ? 0x85 : block_size == 2 ? 0x86 : block_size == 3 ? 0x87 : 't';
            *p++ = 0x94; *p++ = 'N'; *p++ = 0x87; *p++ = 0x94; *p++ = '.';
            uint64_t frame = (uint64_t)(p - buf) - 11;
            for (int k = 0; k < 8; k++) buf[3 + k] = (unsigned char)(frame >> (8 * k));
        }
        memcpy(buf + parent_at, parent, DIGEST);
        SHA256(buf, (size_t)(p - buf), digests + i * DIGEST);
        parent = digests + i * DIGEST;
    }
    free(buf);
    return 0;
}

/* The arguments both entry points share, checked. */
static int check_shape(Py_ssize_t block_size, PyObject *parent_obj, int layout) {
    if (layout != 0 && layout != 1) { PyErr_Format(PyExc_ValueError, "layout %d is not 0 or 1", layout); return -1; }
    if (PyBytes_GET_SIZE(parent_obj) != DIGEST) { PyErr_Format(PyExc_ValueError, "parent is not 32 bytes"); return -1; }
    if (block_size < 1) { PyErr_Format(PyExc_ValueError, "bad block range"); return -1; }
    if (block_size * 5 + 64 > MAX_PAYLOAD) { PyErr_Format(PyExc_ValueError, "block_size too large"); return -1; }
    return 0;
}

/* Blocks from which a chain in the calling thread releases the GIL: below it, handing the GIL to
 * another thread and waiting to take it back would cost more than the hashing. */
#define RELEASE_GIL_BLOCKS 64

/* Run the chain (the GIL released for RELEASE_GIL_BLOCKS blocks or more), then append the digests
 * to the list out. */
static int chain_into(PyObject *out, const uint32_t *ids, Py_ssize_t nblocks, Py_ssize_t block_size,
                      PyObject *parent_obj, int layout) {
    if (nblocks == 0) return 0;
    unsigned char parent[DIGEST];
    memcpy(parent, PyBytes_AS_STRING(parent_obj), DIGEST);
    unsigned char *digests = PyMem_RawMalloc((size_t)nblocks * DIGEST);
    if (digests == NULL) { PyErr_NoMemory(); return -1; }
    int rc;
    if (nblocks >= RELEASE_GIL_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        rc = hash_blocks(ids, nblocks, block_size, parent, layout, digests);
        Py_END_ALLOW_THREADS
    } else {
        rc = hash_blocks(ids, nblocks, block_size, parent, layout, digests);
    }
    if (rc < 0) { PyMem_RawFree(digests); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + i * DIGEST, DIGEST);
        if (digest == NULL || PyList_Append(out, digest) < 0) {
            Py_XDECREF(digest);
            PyMem_RawFree(digests);
            return -1;
        }
        Py_DECREF(digest);
    }
    PyMem_RawFree(digests);
    return 0;
}

static PyObject *extend(PyObject *self, PyObject *args) {
    PyObject *block_hashes, *token_ids, *parent_obj;
    Py_ssize_t start, end, block_size;
    int layout;
    if (!PyArg_ParseTuple(args, "O!OnnnSi", &PyList_Type, &block_hashes, &token_ids, &start, &end, &block_size,
                          &parent_obj, &layout))
        return NULL;
    if (check_shape(block_size, parent_obj, layout) < 0) return NULL;
    if (start < 0 || end < start) return PyErr_Format(PyExc_ValueError, "bad block range");
    PyObject *seq = PySequence_Fast(token_ids, "token_ids must be a sequence");
    if (seq == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) < end * block_size) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "token_ids shorter than end * block_size");
    }
    PyObject **items = PySequence_Fast_ITEMS(seq) + start * block_size;
    Py_ssize_t n = (end - start) * block_size;
    uint64_t limit = layout == 0 ? 0xffffffffULL : 0x7fffffffULL;
    uint32_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (ids == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
    /* Check (and copy) every id first: on a bad one nothing is appended. */
    for (Py_ssize_t t = 0; t < n; t++) {
        PyObject *o = items[t];
        if (!PyLong_CheckExact(o)) goto out_of_range;  /* bools and int subclasses encode otherwise */
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || v < 0 || (uint64_t)v > limit) goto out_of_range;
        ids[t] = (uint32_t)v;
    }
    int rc = chain_into(block_hashes, ids, end - start, block_size, parent_obj, layout);
    PyMem_Free(ids);
    Py_DECREF(seq);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
out_of_range:
    PyMem_Free(ids);
    Py_DECREF(seq);
    return PyErr_Format(PyExc_ValueError, "a token id outside the compiled encoder's range");
}

/* The first n little-endian int32 token ids of raw into ids, whatever this machine's byte order;
 * -1 at a negative id (outside both layouts' range). Touches no Python object. */
static int read_int32_ids(const unsigned char *raw, Py_ssize_t n, uint32_t *ids) {
    for (Py_ssize_t t = 0; t < n; t++) {
        const unsigned char *b = raw + 4 * t;
        uint32_t v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        if (v > 0x7fffffffU) return -1;
        ids[t] = v;
    }
    return 0;
}

static PyObject *chain_packed(PyObject *self, PyObject *args) {
    Py_buffer data;
    PyObject *parent_obj;
    Py_ssize_t block_size;
    int layout;
    if (!PyArg_ParseTuple(args, "y*nSi", &data, &block_size, &parent_obj, &layout)) return NULL;
    PyObject *out = NULL;
    uint32_t *ids = NULL;
    if (check_shape(block_size, parent_obj, layout) < 0) goto done;
    if (data.len % 4) {
        PyErr_Format(PyExc_ValueError, "%zd bytes, not a multiple of 4 (little-endian int32 token ids)", data.len);
        goto done;
    }
    Py_ssize_t nblocks = data.len / 4 / block_size, n = nblocks * block_size;
    ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (ids == NULL) { PyErr_NoMemory(); goto done; }
    if (read_int32_ids(data.buf, n, ids) < 0) {
        PyErr_Format(PyExc_ValueError, "a token id outside the compiled encoder's range");
        goto done;
    }
    out = PyList_New(0);
    if (out != NULL && chain_into(out, ids, nblocks, block_size, parent_obj, layout) < 0) Py_CLEAR(out);
done:
    PyMem_Free(ids);
    PyBuffer_Release(&data);
    return out;
}

/* PackedChains(prompts, block_size, parent, layout): the chains of many packed prompts, hashed by
 * run() in whatever thread calls it, with the GIL released throughout, while another thread takes
 * each prompt's hashes with hashes(i) as soon as that prompt is done (waiting, GIL released, until
 * then: so run() must have been handed to a thread first). A prompt with a negative token id or a
 * length that is not a multiple of 4 gives None.
 * Each prompt's lock is held from construction until run() has hashed it. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    Py_buffer *bufs;
    Py_ssize_t block_size;
    int layout;
    unsigned char root[DIGEST];
    unsigned char **digests;    /* per prompt: nblocks[i] * DIGEST bytes (RawMalloc), or NULL */
    Py_ssize_t *nblocks;        /* per prompt; -1: not covered */
    PyThread_type_lock *done;   /* per prompt: held until hashed */
    PyThread_type_lock ran;     /* held until run() returns */
    int started;
} PackedChains;

static void chains_dealloc(PackedChains *self) {
    if (self->started && self->ran != NULL) {  /* run() reads the buffers: wait for it */
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->ran, WAIT_LOCK);
        Py_END_ALLOW_THREADS
        PyThread_release_lock(self->ran);
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (self->bufs != NULL && self->bufs[i].obj != NULL) PyBuffer_Release(&self->bufs[i]);
        if (self->digests != NULL) PyMem_RawFree(self->digests[i]);
        if (self->done != NULL && self->done[i] != NULL) PyThread_free_lock(self->done[i]);
    }
    if (self->ran != NULL) PyThread_free_lock(self->ran);
    PyMem_Free(self->bufs);
    PyMem_Free(self->digests);
    PyMem_Free(self->nblocks);
    PyMem_Free(self->done);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *chains_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *prompts, *parent_obj;
    Py_ssize_t block_size;
    int layout;
    if (!PyArg_ParseTuple(args, "O!nSi", &PyList_Type, &prompts, &block_size, &parent_obj, &layout)) return NULL;
    if (check_shape(block_size, parent_obj, layout) < 0) return NULL;
    /* The prompts as they are now: exporting a buffer can run Python code (a class's __buffer__,
     * PEP 688, Python 3.12+) that changes the list, so read the items from a tuple of them. */
    PyObject *items = PyList_AsTuple(prompts);
    if (items == NULL) return NULL;
    PackedChains *self = (PackedChains *)type->tp_alloc(type, 0);
    if (self == NULL) { Py_DECREF(items); return NULL; }
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    self->block_size = block_size;
    self->layout = layout;
    memcpy(self->root, PyBytes_AS_STRING(parent_obj), DIGEST);
    self->bufs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    self->digests = PyMem_Calloc((size_t)(n ? n : 1), sizeof(unsigned char *));
    self->nblocks = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_ssize_t));
    self->done = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyThread_type_lock));
    self->ran = PyThread_allocate_lock();
    if (self->bufs == NULL || self->digests == NULL || self->nblocks == NULL || self->done == NULL || self->ran == NULL) {
        Py_DECREF(items);
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    PyThread_acquire_lock(self->ran, WAIT_LOCK);
    for (Py_ssize_t i = 0; i < n; i++) {
        self->done[i] = PyThread_allocate_lock();
        self->n = i + 1;  /* what dealloc cleans up */
        if (self->done[i] == NULL) { Py_DECREF(items); Py_DECREF(self); return PyErr_NoMemory(); }
        PyThread_acquire_lock(self->done[i], WAIT_LOCK);
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(items, i), &self->bufs[i], PyBUF_SIMPLE) < 0) {
            Py_DECREF(items);
            Py_DECREF(self);
            return NULL;
        }
    }
    Py_DECREF(items);
    return (PyObject *)self;
}

/* One prompt's chain, no GIL held: digests[i] and nblocks[i] (-1 when not covered). */
static void chain_one(PackedChains *self, Py_ssize_t i) {
    self->nblocks[i] = -1;
    Py_ssize_t len = self->bufs[i].len;
    if (len % 4) return;
    Py_ssize_t nblocks = len / 4 / self->block_size, n = nblocks * self->block_size;
    uint32_t *ids = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    unsigned char *digests = PyMem_RawMalloc((size_t)(nblocks ? nblocks : 1) * DIGEST);
    if (ids == NULL || digests == NULL) goto out;
    if (read_int32_ids(self->bufs[i].buf, n, ids) < 0) goto out;
    if (nblocks && hash_blocks(ids, nblocks, self->block_size, self->root, self->layout, digests) < 0) goto out;
    self->digests[i] = digests;
    digests = NULL;
    self->nblocks[i] = nblocks;
out:
    PyMem_RawFree(ids);
    PyMem_RawFree(digests);
}

static PyObject *chains_run(PackedChains *self, PyObject *unused) {
    if (self->started) return PyErr_Format(PyExc_RuntimeError, "run() was called already");
    self->started = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < self->n; i++) {
        chain_one(self, i);
        PyThread_release_lock(self->done[i]);
    }
    PyThread_release_lock(self->ran);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *chains_hashes(PackedChains *self, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= self->n) return PyErr_Format(PyExc_IndexError, "prompt %zd of %zd", i, self->n);
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->done[i], WAIT_LOCK);
    Py_END_ALLOW_THREADS
    PyThread_release_lock(self->done[i]);
    if (self->nblocks[i] < 0) Py_RETURN_NONE;
    PyObject *out = PyList_New(self->nblocks[i]);
    if (out == NULL) return NULL;
    for (Py_ssize_t b = 0; b < self->nblocks[i]; b++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)self->digests[i] + b * DIGEST, DIGEST);
        if (digest == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, b, digest);
    }
    return out;
}

static PyMethodDef chains_methods[] = {
    {"run", (PyCFunction)chains_run, METH_NOARGS,
     "Hash every prompt in order, with the GIL released (once; from the thread that is to hash)."},
    {"hashes", (PyCFunction)chains_hashes, METH_O,
     "hashes(i): prompt i's block hashes once run() has hashed it (waiting until then: hand run() to a thread "
     "first), or None when a token id is negative or the length is not a multiple of 4."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PackedChainsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvservice_client._hashchain.PackedChains",
    .tp_basicsize = sizeof(PackedChains),
    .tp_dealloc = (destructor)chains_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PackedChains(prompts, block_size, parent, layout): many packed prompts' chains, hashed by run() "
              "in one thread, taken by hashes(i) in another.",
    .tp_methods = chains_methods,
    .tp_new = chains_new,
};

static PyMethodDef methods[] = {
    {"extend", extend, METH_VARARGS,
     "extend(block_hashes, token_ids, start, end, block_size, parent, layout): append the chained SHA-256 block "
     "hashes of blocks start..end-1 (layout 0: canonical CBOR, 1: pickle protocol 5)."},
    {"chain_packed", chain_packed, METH_VARARGS,
     "chain_packed(data, block_size, parent, layout): the chained SHA-256 block hashes of every full block of "
     "little-endian int32 token ids, as a new list; the GIL is released while hashing."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hashchain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hashchain(void) {
    if (PyType_Ready(&PackedChainsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PackedChainsType);
    if (PyModule_AddObject(m, "PackedChains", (PyObject *)&PackedChainsType) < 0) {
        Py_DECREF(&PackedChainsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
