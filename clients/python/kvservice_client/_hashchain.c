/* Optional compiled fast path of the block-hash chain (kvservice_client.hashing).
 *
 * extend(block_hashes, token_ids, start, end, block_size, parent, layout) appends
 *     hash[i] = SHA-256(encode((parent, tuple(token_ids[i*bs:(i+1)*bs]), None)))
 * for blocks start..end-1 to the list block_hashes, chaining parent, where encode is
 *     layout 0: canonical CBOR (RFC 8949 section 4.2.1), as cbor2.dumps(..., canonical=True);
 *     layout 1: pickle protocol 5, as pickle.dumps(..., protocol=5) (Python's C pickler).
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

static PyObject *extend(PyObject *self, PyObject *args) {
    PyObject *block_hashes, *token_ids, *parent_obj;
    Py_ssize_t start, end, block_size;
    int layout;
    if (!PyArg_ParseTuple(args, "O!OnnnSi", &PyList_Type, &block_hashes, &token_ids, &start, &end, &block_size,
                          &parent_obj, &layout))
        return NULL;
    if (layout != 0 && layout != 1) return PyErr_Format(PyExc_ValueError, "layout %d is not 0 or 1", layout);
    if (PyBytes_GET_SIZE(parent_obj) != DIGEST) return PyErr_Format(PyExc_ValueError, "parent is not 32 bytes");
    if (block_size < 1 || start < 0 || end < start) return PyErr_Format(PyExc_ValueError, "bad block range");
    if (block_size * 5 + 64 > MAX_PAYLOAD) return PyErr_Format(PyExc_ValueError, "block_size too large");
    PyObject *seq = PySequence_Fast(token_ids, "token_ids must be a sequence");
    if (seq == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) < end * block_size) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "token_ids shorter than end * block_size");
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t limit = layout == 0 ? 0xffffffffULL : 0x7fffffffULL;
    /* Check every id first: on a bad one nothing is appended. */
    for (Py_ssize_t t = start * block_size; t < end * block_size; t++) {
        PyObject *o = items[t];
        if (!PyLong_CheckExact(o)) goto out_of_range;  /* bools and int subclasses encode otherwise */
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || v < 0 || (uint64_t)v > limit) goto out_of_range;
    }
    size_t cap = (size_t)block_size * 5 + 64;
    unsigned char *buf = PyMem_Malloc(cap);
    if (buf == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
    unsigned char parent[DIGEST];
    memcpy(parent, PyBytes_AS_STRING(parent_obj), DIGEST);
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
    int failed = 0;
    for (Py_ssize_t i = start; i < end; i++) {
        unsigned char *p = buf + body_at;
        PyObject **block = items + i * block_size;
        if (layout == 0) {
            for (Py_ssize_t k = 0; k < block_size; k++)
                p += cbor_uint(p, 0, (uint64_t)PyLong_AsUnsignedLongLong(block[k]));
            *p++ = 0xf6;  /* None */
        } else {
            for (Py_ssize_t k = 0; k < block_size; k++)
                p += pickle_int(p, (uint32_t)PyLong_AsUnsignedLong(block[k]));
            *p++ = block_size == 1 ? 0x85 : block_size == 2 ? 0x86 : block_size == 3 ? 0x87 : 't';
            *p++ = 0x94; *p++ = 'N'; *p++ = 0x87; *p++ = 0x94; *p++ = '.';
            uint64_t frame = (uint64_t)(p - buf) - 11;
            for (int k = 0; k < 8; k++) buf[3 + k] = (unsigned char)(frame >> (8 * k));
        }
        memcpy(buf + parent_at, parent, DIGEST);
        SHA256(buf, (size_t)(p - buf), parent);
        PyObject *digest = PyBytes_FromStringAndSize((const char *)parent, DIGEST);
        if (digest == NULL || PyList_Append(block_hashes, digest) < 0) {
            Py_XDECREF(digest);
            failed = 1;
            break;
        }
        Py_DECREF(digest);
    }
    PyMem_Free(buf);
    Py_DECREF(seq);
    if (failed) return NULL;
    Py_RETURN_NONE;
out_of_range:
    Py_DECREF(seq);
    return PyErr_Format(PyExc_ValueError, "a token id outside the compiled encoder's range");
}

static PyMethodDef methods[] = {
    {"extend", extend, METH_VARARGS,
     "extend(block_hashes, token_ids, start, end, block_size, parent, layout): append the chained SHA-256 block "
     "hashes of blocks start..end-1 (layout 0: canonical CBOR, 1: pickle protocol 5)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hashchain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hashchain(void) { return PyModule_Create(&module); }
